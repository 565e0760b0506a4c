"""Staff lists over tables of millions of rows (the API's lists and the admin's), under
PTC_DB_STATEMENT_TIMEOUT: they are counted exactly up to 10,000 rows, and past them (or past
half a second of counting) by PostgreSQL's planner's estimate (ptcproject.paging).

A table of millions is shown by its planner statistics: a table of 10,050 rows whose pg_class
entry says it holds 50 million, as ANALYZE would say of a table that does."""

import re
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.contrib import admin
from django.contrib.auth import get_user_model
from django.db import connection
from django.db.models import BooleanField
from django.db.models.expressions import RawSQL
from django.test import Client
from django.test.utils import CaptureQueriesContext

from billing.models import CreditUsage
from execution.models import ToolCall
from ptcproject.admin_lists import LargeListAdmin
from ptcproject.api import Pagination
from ptcproject.paging import COUNT_EXACT_UP_TO, COUNT_SECONDS, EstimatingPaginator
from tests.conftest import Api
from tests.factories import finished_calls

PLANNED = 50_000_000
ROWS = COUNT_EXACT_UP_TO + 50


@pytest.fixture
def huge_usage() -> Iterator[Any]:
    """A user with ROWS usage rows, in a table the planner believes holds PLANNED rows; the rows
    gone and the statistics true again after."""
    user = get_user_model().objects.create_user(username=f"huge-{uuid.uuid4().hex[:6]}")
    CreditUsage.objects.bulk_create(
        CreditUsage(user=user, tool_call_id=f"ptc_{uuid.uuid4().hex}", amount=1, due_amount=1) for _ in range(ROWS)
    )
    with connection.cursor() as cursor:
        # As ANALYZE finds it, but for its rows per page: the planner scales reltuples by the
        # pages the table has now (relpages as ANALYZE left it), so it expects PLANNED rows.
        cursor.execute("ANALYZE billing_creditusage")
        cursor.execute("UPDATE pg_class SET reltuples = %s WHERE relname = 'billing_creditusage'", [PLANNED])
    try:
        yield user
    finally:
        CreditUsage.objects.filter(user=user).delete()
        with connection.cursor() as cursor:
            cursor.execute("ANALYZE billing_creditusage")


def _admin_client() -> Client:
    staff = get_user_model().objects.create_user(username=f"admin-{uuid.uuid4().hex[:6]}", is_staff=True, is_superuser=True)
    client = Client()
    client.force_login(staff)
    return client


def test_every_admin_list_is_counted_at_scale() -> None:
    """Django's paginator counted every row of a list each load, and show_full_result_count every
    row of the table again; each of our admins counts as ptcproject.paging does."""
    counting = {
        type(model_admin).__name__: (model_admin.paginator, model_admin.show_full_result_count)
        for model_admin in admin.site._registry.values()
        if not isinstance(model_admin, LargeListAdmin)
        or model_admin.paginator is not EstimatingPaginator
        or model_admin.show_full_result_count
    }
    assert not counting, counting


def test_a_count_that_would_run_past_its_budget_is_the_planners_estimate() -> None:
    """A list whose rows take long to find (a filter no index serves, over a table of millions; here
    a filter that sleeps 0.5 s a row) is counted for COUNT_SECONDS at most, then estimated: its page
    answers instead of running into PTC_DB_STATEMENT_TIMEOUT."""
    user = get_user_model().objects.create_user(username=f"slow-{uuid.uuid4().hex[:6]}")
    CreditUsage.objects.bulk_create(
        CreditUsage(user=user, tool_call_id=f"ptc_{uuid.uuid4().hex}", amount=1, due_amount=1) for _ in range(10)
    )
    slow = RawSQL("pg_sleep(0.5) IS NOT NULL", [], output_field=BooleanField())
    rows = CreditUsage.objects.filter(user=user).alias(slow=slow).filter(slow=True).order_by("-id")
    paginator = Pagination.django_paginator_class(rows, 100)
    started = time.monotonic()
    count = paginator.count  # counted whole, 5 s
    took = time.monotonic() - started
    # Never under the bound: a list said to hold a page or less would be drawn whole (the admin's).
    assert getattr(paginator, "estimated", False) and count > COUNT_EXACT_UP_TO, count
    assert took < COUNT_SECONDS + 2, took
    page = paginator.page(1)  # read as a page is: 5 s here, but its ten rows, all there
    assert len(page.object_list) == 10 and not page.has_next()
    assert (paginator.count, paginator.estimated) == (10, False)  # its last page counted it


def test_the_staff_api_list_of_a_huge_table_answers_with_an_estimate(huge_usage: Any, make_api: Callable[..., Api]) -> None:
    """GET /billing/usage as staff lists every user's usage: its count was every row of the table,
    past PTC_DB_STATEMENT_TIMEOUT on a large deployment (503). It is now the planner's estimate, and
    its pages still follow one another by their next links; a user's own list is counted exactly."""
    staff = make_api(staff=True)
    first = staff.get("/api/v1/billing/usage", params={"page_size": 500})
    assert first.status_code == 200, first.text
    body = first.json()
    assert body["count"] > PLANNED // 2, body["count"]  # not the ~10,000 rows there are
    assert len(body["results"]) == 500 and body["next"] and body["previous"] is None
    second = staff.get(body["next"])
    assert second.status_code == 200, second.text
    assert {row["id"] for row in second.json()["results"]}.isdisjoint({row["id"] for row in body["results"]})
    assert second.json()["previous"]
    last = staff.get("/api/v1/billing/usage", params={"page": "last"})
    assert last.status_code == 400 and last.json()["error"]["details"]["page"], last.text
    # Past the last page there is: 404, as before, though the estimate has pages there.
    past = staff.get("/api/v1/billing/usage", params={"page": 10_000, "page_size": 500})
    assert past.status_code == 404, past.text

    own = make_api()
    CreditUsage.objects.bulk_create(
        CreditUsage(
            user_id=get_user_model().objects.get(username=own.username).pk,
            tool_call_id=f"ptc_{i}_{uuid.uuid4().hex}",
            amount=1,
            due_amount=1,
        )
        for i in range(3)
    )
    mine = own.get("/api/v1/billing/usage", params={"page_size": 2})
    assert mine.status_code == 200 and mine.json()["count"] == 3 and mine.json()["next"], mine.text
    assert own.get("/api/v1/billing/usage", params={"page": "last", "page_size": 2}).json()["results"]


def test_the_admin_list_of_a_huge_table_reads_no_more_than_it_counts(huge_usage: Any) -> None:
    """The usage list in the admin counted the whole table each load. It now reads at most
    COUNT_EXACT_UP_TO + 1 rows to count, says "about" the planner's estimate, and pages on."""
    client = _admin_client()
    with CaptureQueriesContext(connection) as queries:
        page = client.get("/admin/billing/creditusage/")
    assert page.status_code == 200
    counts = [query["sql"] for query in queries.captured_queries if query["sql"].startswith("SELECT COUNT(*)")]
    assert counts and all("LIMIT" in sql for sql in counts), counts
    said = re.search(r"about (\d+) credit usages", page.content.decode())
    assert said and int(said[1]) > PLANNED // 2, page.content.decode()[-3000:]
    assert client.get("/admin/billing/creditusage/?p=2").status_code == 200


@pytest.fixture
def huge_calls() -> Iterator[Any]:
    """A user with ROWS finished calls, in a table the planner believes holds PLANNED rows (as
    huge_usage's); the rows gone and the statistics true again after."""
    user = get_user_model().objects.create_user(username=f"huge-{uuid.uuid4().hex[:6]}")
    finished_calls(user=user, rows=ROWS)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE execution_toolcall")
        cursor.execute("UPDATE pg_class SET reltuples = %s WHERE relname = 'execution_toolcall'", [PLANNED])
    try:
        yield user
    finally:
        ToolCall.objects.filter(user=user).delete()
        with connection.cursor() as cursor:
            cursor.execute("ANALYZE execution_toolcall")


def test_select_all_of_a_huge_admin_list_says_about_its_estimate(huge_calls: Any) -> None:
    """The list's "Select all N" and "All N selected", for its every row, said the planner's
    estimate as a count; they say "about" it, as the paginator does."""
    page = _admin_client().get("/admin/execution/toolcall/").content.decode()
    select_all = re.search(r"Select all (of about )?(\d+) tool calls", page)
    all_selected = re.search(r"All (of about )?(\d+) selected", page)
    assert select_all and all_selected, page[-3000:]
    assert int(select_all[2]) > PLANNED // 2 and select_all[1] and all_selected[1], (select_all[0], all_selected[0])


def test_the_staff_api_lists_read_a_page_not_the_table() -> None:
    """A staff member's lists of every job, call and usage row: each query of a page but its count
    (which stops at COUNT_EXACT_UP_TO + 1 rows) reads a page of its table, not the table. The calls
    were in start order, by started_at, which has no index of its own (each call writes its row
    twice, into every index): each page read and sorted every call of the deployment."""
    from ptcproject.accounts.services import user_with_key_create
    from tests.test_admin import _many_calls, _many_jobs, _much_usage, _rows_read

    crowd = get_user_model().objects.create_user(username=f"crowd-{uuid.uuid4().hex[:6]}")
    for make in (_many_calls, _many_jobs, _much_usage):
        make(crowd)
    _, key = user_with_key_create(username=f"staff-{uuid.uuid4().hex[:6]}", create_user=True, staff=True)
    client = Client(HTTP_AUTHORIZATION=f"Bearer {key}")
    for path, table in (
        ("/api/v1/tool-calls", "execution_toolcall"),
        ("/api/v1/exec", "execution_execjob"),
        ("/api/v1/billing/usage", "billing_creditusage"),
    ):
        with connection.cursor() as cursor:
            cursor.execute(f"ANALYZE {table}")  # as autovacuum would have: the planner knows the table is not small
        with CaptureQueriesContext(connection) as queries:
            response = client.get(path, {"page_size": 100})
            body = b"".join(response.streaming_content)  # type: ignore[attr-defined]
        assert response.status_code == 200, body[:500]
        read = {
            query["sql"][:300]: _rows_read(query["sql"], table)
            for query in queries.captured_queries
            # Not its count, nor the planner's estimate a count past its half second falls back on.
            if f'"{table}"' in query["sql"] and not query["sql"].startswith(("SELECT COUNT(*)", "EXPLAIN"))
        }
        assert read and all(rows <= 200 for rows in read.values()), (path, read)
