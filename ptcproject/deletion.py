"""What deleting some rows would take with them, counted in the database rather than read."""

from collections.abc import Iterable
from functools import reduce
from operator import or_
from typing import Any

from django.db.models import CASCADE, PROTECT, RESTRICT, Model, Q


def deletion_counts(*, model: type[Model], pks: Iterable[Any]) -> tuple[dict[type[Model], int], dict[type[Model], int]]:
    """Return, for deleting ``model``'s rows ``pks``, the rows of each model the delete would take
    (``model``'s own among them; its cascades followed through), and the rows of each model that a
    PROTECT or RESTRICT relation would refuse it for. Each model is counted once, however many ways
    its rows are reached (a job's calls are also its user's), by one query: the rows are never read.

    Django's delete page read every row a delete would take, whole (a user's 10,000 calls were 13 s
    and 65 MB, a million of them far past any request's timeout), to draw a link to each.
    """
    pks = list(pks)
    reached: dict[type[Model], list[Q]] = {model: [Q(pk__in=pks)]}
    protecting: dict[type[Model], list[Q]] = {}

    def rows(of: type[Model]) -> Any:
        return of._base_manager.filter(reduce(or_, reached[of]))

    def walk(parent: type[Model], lookup: Q, path: tuple[type[Model], ...]) -> None:
        for relation in parent._meta.related_objects:
            if relation.many_to_many or relation.on_delete not in (CASCADE, PROTECT, RESTRICT):
                continue  # a link row, or a row that is kept (SET_NULL, DO_NOTHING...)
            child, field = relation.related_model, relation.field
            # The parents as this one path reaches them, by the value the child's column holds.
            parents = parent._base_manager.filter(lookup).values(field.target_field.attname)
            child_lookup = Q(**{f"{field.attname}__in": parents})
            if relation.on_delete is CASCADE:
                reached.setdefault(child, []).append(child_lookup)
                if child not in path:  # a cycle of cascades: its rows are reached already
                    walk(child, child_lookup, (*path, child))
            else:
                protecting.setdefault(child, []).append(child_lookup)

    walk(model, Q(pk__in=pks), (model,))
    deleted = {of: count for of in reached if (count := rows(of).count())}
    protected = {
        of: count for of, lookups in protecting.items() if (count := of._base_manager.filter(reduce(or_, lookups)).count())
    }
    return deleted, protected
