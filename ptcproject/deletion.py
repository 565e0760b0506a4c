"""What deleting some rows would take with them, counted in the database rather than read."""

from collections.abc import Callable, Iterable
from functools import reduce
from itertools import islice
from operator import or_
from typing import Any

from django.db import connections
from django.db.models import CASCADE, PROTECT, RESTRICT, Model, Q, QuerySet

# Rows written or deleted a statement at a time: a few tens of milliseconds each (a call unlinked
# from its tool about 35 ms a thousand), far under any PTC_DB_STATEMENT_TIMEOUT.
BATCH = 1000


Lookups = dict[type[Model], list[Q]]  # each model's rows, by one lookup per path that reaches them


def _reach(model: type[Model], pks: list[Any]) -> tuple[Lookups, Lookups, Lookups]:
    """Return, for deleting ``model``'s rows ``pks``, the lookups of the rows of each model the
    delete would take (its cascades followed through), of the rows that a PROTECT or RESTRICT
    relation would refuse it for, and of the rows those relations name (a user's credit account,
    that the ledger's entries name)."""
    reached: Lookups = {model: [Q(pk__in=pks)]}
    protecting: Lookups = {}
    named: Lookups = {}

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
                named.setdefault(parent, []).append(lookup)

    walk(model, Q(pk__in=pks), (model,))
    return reached, protecting, named


def _rows(of: type[Model], lookups: list[Q]) -> QuerySet[Any]:
    return of._base_manager.filter(reduce(or_, lookups))


def deletion_counts(*, model: type[Model], pks: Iterable[Any]) -> tuple[dict[type[Model], int], dict[type[Model], int]]:
    """Return, for deleting ``model``'s rows ``pks``, the rows of each model the delete would take
    (``model``'s own among them; its cascades followed through), and the rows of each model that a
    PROTECT or RESTRICT relation would refuse it for. Each model is counted once, however many ways
    its rows are reached (a job's calls are also its user's), by one query: the rows are never read.

    Django's delete page read every row a delete would take, whole (a user's 10,000 calls were 13 s
    and 65 MB, a million of them far past any request's timeout), to draw a link to each.
    """
    reached, protecting, _ = _reach(model, list(pks))
    deleted = {of: count for of, lookups in reached.items() if (count := _rows(of, lookups).count())}
    protected = {of: count for of, lookups in protecting.items() if (count := _rows(of, lookups).count())}
    return deleted, protected


def deletion_lock(*, model: type[Model], pks: Iterable[Any]) -> None:
    """Lock ``model``'s rows ``pks``, and the rows their delete would take that a PROTECT or RESTRICT
    relation names (a user's credit account, that the ledger's entries name), until the transaction
    ends: a row that would name one (a user's new job, an account's new ledger entry) waits until
    then, its foreign key's check on the lock, and one being written is waited for. What is
    counted after this, in the transaction (deletion_counts), is what the delete in it meets.

    Checked before the lock, a ledger entry written between the check and the delete made it fail
    (ProtectedError, or the foreign key's violation at the commit): a 500, and the admin's bulk
    delete, a batch a transaction, had deleted the user's history by then and kept the user."""
    pks = list(pks)
    _, _, named = _reach(model, pks)
    # The chosen rows before the rows they reach, each model's in the order of its key: two deletes
    # of one row at once wait for each other, rather than deadlock.
    for of, lookups in ((model, [Q(pk__in=pks)]), *named.items()):
        list(_rows(of, lookups).order_by("pk").select_for_update().values_list("pk", flat=True))


def update_in_batches(rows: QuerySet[Any], *, size: int = BATCH, **values: Any) -> int:
    """Set ``values`` on ``rows``, ``size`` rows a statement, until none is left; return how many
    rows were updated. ``values`` must take a row out of ``rows`` (a link set to null, say), or
    this never ends.

    One UPDATE of every row runs past PTC_DB_STATEMENT_TIMEOUT at a few million rows (16 µs a row
    here: 30 s at two million), and what it was part of (a delete's unlinking) failed, every time.
    Each statement is its own transaction outside ``atomic`` (work interrupted part way, tried
    again, goes on where it stopped), or the caller's within it (all or nothing; the rows are those
    one scan finds, at its start)."""
    return _in_batches(rows, size, lambda batch: batch.update(**values))


def delete_in_batches(rows: QuerySet[Any], *, size: int = BATCH) -> int:
    """Delete ``rows``, ``size`` rows a statement (Django's delete of each batch, its cascades and
    unlinks with it), until none is left; return how many of ``rows`` were deleted. Django deletes
    a model without cascades of its own with one DELETE of every row, and collects one with them
    whole (every row's id read, then each related table's rows IN that list): past the statement
    timeout, or any memory, for a user's millions of calls or jobs. Transactions as
    update_in_batches'."""
    label = rows.model._meta.label
    return _in_batches(rows, size, lambda batch: batch.delete()[1].get(label, 0))


def _in_batches(rows: QuerySet[Any], size: int, apply: Callable[[QuerySet[Any]], int]) -> int:
    rows = rows.order_by()  # by the model's ordering, each batch sorted every row of the table
    done = 0
    if connections[rows.db].in_atomic_block:
        # The caller's one transaction (the admin's delete): the rows a batch takes stay in every
        # scan of it till it ends, and each batch's scan went over all the batches before it took.
        # The keys by one scan instead, a batch a fetch (a server-side cursor, ``iterator``), each
        # batch taken by its keys alone: with the rows' filter again, the planner may take that
        # filter's index and go over every row it names (the calls an approver decided: 8 s a
        # batch). A row written since the scan began is left to the caller's delete (Django's,
        # of the rows it hangs on, takes what is left).
        keys = rows.values_list("pk", flat=True).iterator(chunk_size=size)
        while batch := list(islice(keys, size)):
            done += apply(rows.model._base_manager.filter(pk__in=batch))
        return done
    while True:
        # Each batch its own transaction, found by a subquery (... WHERE id IN (SELECT id ...
        # LIMIT size)): no ids come to Python, and a delete cut off goes on where it stopped.
        count = apply(rows.model._base_manager.filter(pk__in=rows.values("pk")[:size]))
        done += count
        if count < size:  # the last batch; a row another transaction took meanwhile is not waited for
            return done
