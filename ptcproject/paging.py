"""Pages of lists over tables of millions of rows (the API's lists, the admin's), counted without
reading the table: Django's paginator counts every row (``SELECT COUNT(*)``), which on the tool
calls, jobs or ledger of a large deployment ran past PTC_DB_STATEMENT_TIMEOUT and failed the page.

A list's count is exact up to COUNT_EXACT_UP_TO rows, if counting them takes at most COUNT_SECONDS
(a filter no index serves may have to read the whole table to find a few rows); past either, it is
PostgreSQL's planner's estimate (EXPLAIN), and never under COUNT_EXACT_UP_TO + 1: a list said to
hold no more than a page would be drawn whole (the admin's), and one that is slow to count may be
long. Such a page is read as ``per_page + 1`` rows, the last telling whether there is a next page:
the links never depend on the estimate; and a page with none after it makes the count exact.
"""

import json
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from django.conf import settings
from django.core.paginator import EmptyPage, Page, Paginator
from django.db import OperationalError, connections, transaction
from django.db.models import QuerySet
from django.utils.functional import cached_property

from ptcproject.db import statement_cancelled

COUNT_EXACT_UP_TO = 10_000
COUNT_SECONDS = 0.5
T = TypeVar("T")


class _Counted(Exception):
    """Carries a count out of its transaction, which is rolled back: its SET LOCAL goes with it."""

    def __init__(self, value: Any) -> None:
        self.value = value


def _within(alias: str, seconds: float, work: Callable[[], T]) -> T:
    """Return what ``work`` returns, its statements cancelled by PostgreSQL past ``seconds`` (an
    OperationalError, ``statement_cancelled``). In a transaction (a savepoint, within one) that is
    rolled back after: the timeout set for it is undone with it, however it ends, also behind
    PgBouncer (``SET LOCAL``, not a session's ``SET``, which outlived the transaction)."""
    timeout = f"{max(1, round(seconds * 1000))}ms"
    try:
        with transaction.atomic(using=alias):
            with connections[alias].cursor() as cursor:
                cursor.execute("SELECT set_config('statement_timeout', %s, true)", [timeout])
            raise _Counted(work())
    except _Counted as counted:
        value: T = counted.value
        return value


def planned_rows(queryset: QuerySet[Any]) -> int:
    """Return how many rows PostgreSQL's planner expects ``queryset`` to return (its statistics:
    ``reltuples`` and the filters' selectivity), without running it."""
    plan = json.loads(queryset.order_by().explain(format="json"))
    return int(plan[0]["Plan"]["Plan Rows"])


def rows_counted(queryset: QuerySet[Any]) -> tuple[int, bool]:
    """Return how many rows ``queryset`` has, and whether that is exact: it is up to
    COUNT_EXACT_UP_TO rows counted within COUNT_SECONDS (or PTC_DB_STATEMENT_TIMEOUT, if shorter);
    past either, the planner's estimate, at least COUNT_EXACT_UP_TO + 1. Exact on any database but
    PostgreSQL (the embedded SQLite, for small deployments)."""
    alias = queryset.db
    if connections[alias].vendor != "postgresql":
        return queryset.count(), True
    seconds = min(COUNT_SECONDS, settings.PTC_DB_STATEMENT_TIMEOUT or COUNT_SECONDS)
    # Counts the rows of a subquery that stops at the bound: a table of millions is read no further.
    bounded = queryset.order_by()[: COUNT_EXACT_UP_TO + 1]
    try:
        counted = _within(alias, seconds, bounded.count)
    except OperationalError as exc:
        if not statement_cancelled(exc):
            raise
    else:
        if counted <= COUNT_EXACT_UP_TO:
            return counted, True
    return max(planned_rows(queryset), COUNT_EXACT_UP_TO + 1), False


class EstimatingPage(Page):
    """A page of a list whose count is an estimate: whether another follows was read with it."""

    def __init__(self, object_list: Any, number: int, paginator: "EstimatingPaginator", *, more: bool) -> None:
        super().__init__(object_list, number, paginator)
        self.more = more

    def has_next(self) -> bool:
        return self.more

    def next_page_number(self) -> int:
        if not self.more:
            raise EmptyPage(self.paginator.error_messages["no_results"])
        return self.number + 1

    def end_index(self) -> int:
        return (self.number - 1) * self.paginator.per_page + len(self.object_list)


class EstimatingPaginator(Paginator):
    """Django's paginator, whose count is ``rows_counted``'s: past COUNT_EXACT_UP_TO rows (or
    COUNT_SECONDS of counting) an estimate, ``estimated`` then True. Such a list's pages are read
    without its count: a page past its last is EmptyPage, as Django's is, and one before it is
    never refused for being past the estimate's last."""

    @cached_property
    def _counted(self) -> tuple[int, bool]:
        if not isinstance(self.object_list, QuerySet):  # a list: its length
            return super().count, True
        return rows_counted(self.object_list)

    @cached_property
    def count(self) -> int:
        return self._counted[0]

    @property
    def estimated(self) -> bool:
        """Whether the count is PostgreSQL's estimate rather than counted."""
        return not self._counted[1]

    def validate_number(self, number: Any) -> int:
        if not self.estimated:
            return super().validate_number(number)
        try:  # as Django's, less the bound from the count
            if isinstance(number, float) and not number.is_integer():
                raise ValueError
            number = int(number)
        except (TypeError, ValueError):
            return super().validate_number(number)  # its PageNotAnInteger
        if number < 1:
            raise EmptyPage(self.error_messages["min_page"])
        return int(number)

    def page(self, number: Any) -> Page:
        number = self.validate_number(number)
        if not self.estimated:
            return super().page(number)
        bottom = (number - 1) * self.per_page
        rows = list(self.object_list[bottom : bottom + self.per_page + 1])
        if not rows and number > 1:
            raise EmptyPage(self.error_messages["no_results"])
        more = len(rows) > self.per_page
        if not more:  # the last page: the count is known
            self.__dict__["_counted"] = (bottom + len(rows), True)
            for counted_from in ("count", "num_pages"):
                self.__dict__.pop(counted_from, None)
        return EstimatingPage(rows[: self.per_page], number, self, more=more)

    def get_elided_page_range(self, number: Any = 1, *, on_each_side: int = 3, on_ends: int = 2) -> Iterator[Any]:
        """Django's links to pages, but for an estimated list none past a few after ``number``:
        the estimate's last page may not exist, and reading one millions of rows in is itself a
        statement past the timeout."""
        if not self.estimated:
            yield from super().get_elided_page_range(number, on_each_side=on_each_side, on_ends=on_ends)
            return
        number = self.validate_number(number)
        start = max(1, number - on_each_side)
        if start > on_ends + 2:
            yield from range(1, on_ends + 1)
            yield self.ELLIPSIS
        else:
            start = 1
        end = min(number + on_each_side, self.num_pages)
        yield from range(start, end + 1)
        if end < self.num_pages:
            yield self.ELLIPSIS
