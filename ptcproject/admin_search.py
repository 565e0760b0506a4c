"""The admin's search over tables of millions of rows, by their indexes."""

from functools import reduce
from operator import or_
from typing import Any

from django.core.exceptions import FieldDoesNotExist, ValidationError
from django.db.models import Field, ForeignKey, Model, Q, QuerySet
from django.http import HttpRequest
from django.utils.text import smart_split, unescape_string_literal

from ptcproject.admin_lists import LargeListAdmin

# Of the rows a related path names (the tools named "search", of every toolset), the most a term is
# looked for among: a page's worth and more, never a table's.
RELATED_MATCHED_MAX = 1000


def exact_match(model: type[Model], path: str, term: str) -> Q | None:
    """Return the condition on ``model``'s own columns under which ``path`` (a field, or a chain of
    foreign keys to one: ``user__username``) equals ``term``, or None if nothing can. A related
    path is looked up first (its rows' keys, at most RELATED_MATCHED_MAX), so the condition is on
    a column of this table with literal values, which its index serves, even OR-ed with others:
    Django's join OR-ed across tables was a scan of this one. A term that is not a value of the
    field (not a UUID, for an id) matches nothing."""
    name, _, rest = path.partition("__")
    try:
        field = model._meta.get_field("id" if name == "pk" else name)
    except FieldDoesNotExist as exc:
        raise ValueError(f"{model.__name__} has no field {name!r} to search") from exc
    if rest:
        if not isinstance(field, ForeignKey):  # a one-to-one field is one too
            raise ValueError(f"{model.__name__}.{name} is not a foreign key to search through")
        related: type[Model] = field.related_model
        inner = exact_match(related, rest, term)
        if inner is None:
            return None
        keys = list(related._base_manager.filter(inner).values_list(field.target_field.attname, flat=True)[:RELATED_MATCHED_MAX])
        return Q(**{f"{field.attname}__in": keys}) if keys else None
    if not isinstance(field, Field):
        raise ValueError(f"{model.__name__}.{name} is not a column to search")
    try:
        value = field.to_python(term)
    except ValidationError:
        return None
    max_length = getattr(field, "max_length", None)
    if max_length is not None and isinstance(value, str) and len(value) > max_length:
        return None
    return Q(**{field.attname: value})


class IndexedSearchAdmin(LargeListAdmin):
    """A list searched for exact values of the columns its indexes serve: ``search_fields`` are
    paths (``call_id``, ``user__username``) each matched whole, case and all. Each word of the
    search must match one of them, as in Django's search. Django's matched each word anywhere in
    each field (``icontains``: ``UPPER(col) LIKE '%word%'``), which no index serves, and OR-ed
    the fields across joins: every search read every row of the table (the calls, jobs or ledger
    of a large deployment), past PTC_DB_STATEMENT_TIMEOUT. ``search_help_text`` says what is
    searched."""

    def get_search_results(self, request: HttpRequest, queryset: QuerySet[Any], search_term: str) -> tuple[QuerySet[Any], bool]:
        paths = self.get_search_fields(request)
        if not (paths and search_term):
            return queryset, False
        for word in smart_split(search_term):
            if word.startswith(('"', "'")) and word[0] == word[-1]:
                word = unescape_string_literal(word)
            matches = [match for path in paths if (match := exact_match(queryset.model, str(path), word)) is not None]
            queryset = queryset.filter(reduce(or_, matches)) if matches else queryset.none()
        return queryset, False
