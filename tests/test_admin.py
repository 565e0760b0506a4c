import json
import re
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any
from urllib.parse import urlencode

import pytest
from django.contrib.auth import get_user_model
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from billing.models import CreditAccount, CreditUsage, LedgerEntry, Plan
from billing.services import credits_adjust
from execution.models import ExecJob, ToolCall, WorkFile
from ptcproject.accounts.models import ApiKey
from tests.conftest import Api
from tests.factories import finished_calls, job_calls, running_job
from tools.models import Tool, Toolset

FORM = "application/x-www-form-urlencoded"  # as a browser posts a form


def test_admin_pages_render_for_staff(api: Api) -> None:
    job = api.run("from ptc_tools.demo import Demo\nprint('hi')\nDemo.add(a=1, b=2)", toolsets=["demo"])
    staff = get_user_model().objects.create_user(username=f"admin-{uuid.uuid4().hex[:6]}", is_staff=True, is_superuser=True)
    client = Client()
    client.force_login(staff)
    pages = [
        "/admin/",
        "/admin/execution/execjob/",
        "/admin/execution/execjob/?status__exact=completed",
        f"/admin/execution/execjob/{job['id']}/change/",
        "/admin/execution/toolcall/",
        "/admin/tools/toolset/",
        "/admin/tools/tool/",
        "/admin/accounts/apikey/",
        "/admin/accounts/apikey/add/",
    ]
    for page in pages:
        response = client.get(page)
        assert response.status_code == 200, page
    detail = client.get(f"/admin/execution/execjob/{job['id']}/change/").content.decode()
    assert job["call_id"] in detail
    assert "<span>print(&#x27;hi&#x27;)</span>" in detail  # the code, a line per row
    assert job["tool_calls"][0]["call_id"] in detail


def test_admin_is_closed_to_non_staff(api: Api) -> None:
    user = get_user_model().objects.get(username=api.username)
    client = Client()
    client.force_login(user)
    assert client.get("/admin/execution/execjob/").status_code == 302


def _rows_read(sql: str, table: str) -> int:
    """How many rows of ``table`` running ``sql`` reads, by its plan as run (EXPLAIN ANALYZE)."""
    with connection.cursor() as cursor:
        cursor.execute(f"EXPLAIN (ANALYZE, FORMAT JSON) {sql}")
        plan = cursor.fetchone()[0]
    plan = json.loads(plan) if isinstance(plan, str) else plan
    read, nodes = 0, [plan[0]["Plan"]]
    while nodes:
        node = nodes.pop()
        if node.get("Relation Name") == table:
            read += node["Actual Rows"] * node["Actual Loops"] + node.get("Rows Removed by Filter", 0)
        nodes.extend(node.get("Plans", []))
    return read


ROWS = 5000


def _many_calls(user: Any) -> None:
    job = running_job(user=user, status="completed", finished_at=timezone.now())
    job_calls(job, [{"started_at": job.created_at}] * ROWS)


def _many_ledger_entries(user: Any) -> None:
    entry = credits_adjust(user=user, amount=1, reason="start")
    # Entries that add up to nothing, so the balance stays the ledger's sum.
    LedgerEntry.objects.bulk_create(
        LedgerEntry(account_id=entry.account_id, kind="adjustment", delta=(-1) ** i, reason="even") for i in range(ROWS)
    )


def _much_usage(user: Any) -> None:
    CreditUsage.objects.bulk_create(
        CreditUsage(user=user, tool_call_id=f"ptc_{uuid.uuid4().hex}", amount=1, due_amount=1) for _ in range(ROWS)
    )


def _many_jobs(user: Any) -> None:
    ExecJob.objects.bulk_create(
        ExecJob(user=user, code="", toolsets=[], timeout_seconds=30, status="completed", closed_at=timezone.now())
        for _ in range(ROWS)
    )


def _many_keys(user: Any) -> None:
    # One a job: as many as the jobs, each ended (so that a user's own keys stay few among them,
    # as test_a_list_filtered_by_a_rare_value_reads_what_it_finds has them).
    _jobs_keys(user)


def _jobs_keys(user: Any) -> None:
    """ROWS keys of an ended job: each with its expiry, revoked."""
    now = timezone.now()
    job = running_job(user=user, status="completed", finished_at=now)
    ApiKey.objects.bulk_create(
        ApiKey(user=user, prefix=uuid.uuid4().hex[:16], key_hash=uuid.uuid4().hex, exec_job=job, expires_at=now, revoked_at=now)
        for _ in range(ROWS)
    )


def _many_files(user: Any) -> None:
    job = running_job(user=user, status="completed", finished_at=timezone.now())
    WorkFile.objects.bulk_create(
        WorkFile(exec_job=job, kind="output", path=f"out/{i}.txt", content=b"1", size=1) for i in range(ROWS)
    )


@pytest.mark.parametrize(
    "page,table,make",
    [
        ("/admin/execution/toolcall/", "execution_toolcall", _many_calls),
        ("/admin/billing/ledgerentry/", "billing_ledgerentry", _many_ledger_entries),
        ("/admin/billing/creditusage/", "billing_creditusage", _much_usage),
        ("/admin/execution/execjob/", "execution_execjob", _many_jobs),
        ("/admin/accounts/apikey/", "accounts_apikey", _many_keys),
        ("/admin/execution/workfile/", "execution_workfile", _many_files),
    ],
)
def test_the_largest_tables_lists_read_a_page_not_the_table(page: str, table: str, make: Callable[[Any], None]) -> None:
    """A row a tool call: the call and ledger lists were ordered by a column with no index (and the
    calls drawn with a date hierarchy over another), so each load read and sorted every row, 1 s at
    400,000 calls and growing with them. Each query of the page but its count now reads a page."""
    make(get_user_model().objects.create_user(username=f"many-{uuid.uuid4().hex[:6]}"))
    with connection.cursor() as cursor:
        cursor.execute(f"ANALYZE {table}")  # as autovacuum would have: the planner knows the table is not small
    staff = get_user_model().objects.create_user(username=f"admin-{uuid.uuid4().hex[:6]}", is_staff=True, is_superuser=True)
    client = Client()
    client.force_login(staff)
    with CaptureQueriesContext(connection) as queries:
        assert client.get(page).status_code == 200
    read = {
        query["sql"][:200]: _rows_read(query["sql"], table)
        for query in queries.captured_queries
        if f'"{table}"' in query["sql"] and not query["sql"].startswith("SELECT COUNT(*)")
    }
    assert read and all(rows <= 200 for rows in read.values()), read


def _calls_few_denied(user: Any) -> None:
    job = running_job(user=user, status="completed", finished_at=timezone.now())
    job_calls(job, [{"started_at": job.created_at, "decision": "denied", "status": "failed"}] * 3)  # the oldest
    job_calls(job, [{"started_at": job.created_at}] * ROWS)


def _entries_few_refunds(user: Any) -> None:
    entry = credits_adjust(user=user, amount=1, reason="start")
    # The oldest, then charges: each kind's entries add up to nothing, so the balance stays the ledger's sum.
    LedgerEntry.objects.bulk_create(
        LedgerEntry(account_id=entry.account_id, kind="refund", delta=(-1) ** i, reason="back") for i in range(2)
    )
    LedgerEntry.objects.bulk_create(
        LedgerEntry(
            account_id=entry.account_id, kind="charge", delta=(-1) ** i, reason="call", tool_call_id=f"ptc_{uuid.uuid4().hex}"
        )
        for i in range(ROWS)
    )


def _files_few(**rare: Any) -> Callable[[Any], None]:
    def make(user: Any) -> None:
        job = running_job(user=user, status="completed", finished_at=timezone.now())
        files = [WorkFile(exec_job=job, kind="input", path=f"in/{i}.txt", content=b"1", size=1, **rare) for i in range(3)]
        files += [WorkFile(exec_job=job, kind="output", path=f"out/{i}.txt", content=b"1", size=1) for i in range(ROWS)]
        WorkFile.objects.bulk_create(files)

    return make


def _keys_few_users(user: Any) -> None:
    """A user's own keys (no job, no expiry, not revoked), then many jobs' keys, each ended."""
    ApiKey.objects.bulk_create(ApiKey(user=user, prefix=uuid.uuid4().hex[:16], key_hash=uuid.uuid4().hex) for _ in range(3))
    _jobs_keys(user)


@pytest.mark.parametrize(
    "page,table,make,found",
    [
        ("/admin/execution/toolcall/?decision__exact=denied", "execution_toolcall", _calls_few_denied, 3),
        ("/admin/billing/ledgerentry/?kind__exact=refund", "billing_ledgerentry", _entries_few_refunds, 2),
        ("/admin/execution/workfile/?kind__exact=input", "execution_workfile", _files_few(), 3),
        ("/admin/execution/workfile/?pending__exact=1", "execution_workfile", _files_few(pending=True), 3),
        ("/admin/accounts/apikey/?expires_at__isnull=True", "accounts_apikey", _keys_few_users, 3),
        ("/admin/accounts/apikey/?revoked_at__isnull=True", "accounts_apikey", _keys_few_users, 3),
    ],
)
def test_a_list_filtered_by_a_rare_value_reads_what_it_finds(
    page: str, table: str, make: Callable[[Any], None], found: int
) -> None:
    """A list filtered by a value few rows hold (a decision among calls, a refund among charges, an
    input or a pending upload among files, a user's own key that does not expire or is not revoked
    among jobs' keys),
    newest first by id: with no index of the column, its page, and its count, read every row newer
    than the oldest it found, to the table's start for a value that is rare and old. Each query of
    the page, its count among them, reads the rows it finds and no other (the rows are other users'
    too: the planner's statistics say the value is rare, as ANALYZE of a large table would)."""
    make(get_user_model().objects.create_user(username=f"rare-{uuid.uuid4().hex[:6]}"))
    with connection.cursor() as cursor:
        cursor.execute(f"ANALYZE {table}")
    staff = get_user_model().objects.create_user(username=f"admin-{uuid.uuid4().hex[:6]}", is_staff=True, is_superuser=True)
    client = Client()
    client.force_login(staff)
    with CaptureQueriesContext(connection) as queries:
        answer = client.get(page)
    # Other tests' rows of the value may be there too: a few, never the table. Counted exactly (under 10,000).
    matching = answer.context["cl"].result_count
    assert answer.status_code == 200 and found <= matching < ROWS // 2
    read = {
        query["sql"][:200]: _rows_read(query["sql"], table) for query in queries.captured_queries if f'"{table}"' in query["sql"]
    }
    assert read and all(rows <= matching + 10 for rows in read.values()), read  # before: every row, 5,000 and more


def test_the_call_list_offers_no_filter_by_type() -> None:
    """No index serves a call's type (one on every call's would be written on every call): a page
    of the rarer type read every call newer than its page, so the list does not offer it."""
    staff = get_user_model().objects.create_user(username=f"admin-{uuid.uuid4().hex[:6]}", is_staff=True, is_superuser=True)
    client = Client()
    client.force_login(staff)
    answer = client.get("/admin/execution/toolcall/")
    assert answer.status_code == 200
    offered = [spec.field_path for spec in answer.context["cl"].filter_specs]
    assert offered == ["status", "decision", "started_at"]  # before: type among them


def test_the_books_lists_make_as_many_queries_for_a_full_page_as_for_a_few_rows() -> None:
    """Django's own joins follow only relations that can't be null: each account's plan and each
    ledger entry's created_by were a query per row (a page of 100, 100 more queries)."""
    staff = get_user_model().objects.create_user(username=f"admin-{uuid.uuid4().hex[:6]}", is_staff=True, is_superuser=True)
    client = Client()
    client.force_login(staff)
    pages = ("/admin/billing/creditaccount/", "/admin/billing/ledgerentry/")

    def queries() -> list[int]:
        counts = []
        for page in pages:
            with CaptureQueriesContext(connection) as made:
                assert client.get(page).status_code == 200
            counts.append(len(made))
        return counts

    def accounts(n: int) -> None:
        for _ in range(n):
            user = get_user_model().objects.create_user(username=f"books-{uuid.uuid4().hex[:6]}")
            credits_adjust(user=user, amount=1, reason="grant", created_by=staff)
            CreditAccount.objects.filter(user=user).update(plan=Plan.objects.create(key=f"p{uuid.uuid4().hex[:8]}", name="P"))

    accounts(2)
    few = queries()
    accounts(30)
    assert queries() == few


def _searched(page: str, table: str, terms: list[str], shown: list[str]) -> None:
    """Search the list ``page`` for each of ``terms``: each finds what ``shown`` names (in the same
    order), and reads a few rows of ``table``, not the table, in every query of the page (its count too)."""
    with connection.cursor() as cursor:
        cursor.execute(f"ANALYZE {table}")  # as autovacuum would have: the planner knows the table is not small
    staff = get_user_model().objects.create_user(username=f"admin-{uuid.uuid4().hex[:6]}", is_staff=True, is_superuser=True)
    client = Client()
    client.force_login(staff)
    for term, expected in zip(terms, shown, strict=True):
        with CaptureQueriesContext(connection) as queries:
            response = client.get(page, {"q": term})
        assert response.status_code == 200, term
        assert expected in response.content.decode(), (term, expected)
        read = {
            query["sql"][:300]: _rows_read(query["sql"], table)
            for query in queries.captured_queries
            if f'"{table}"' in query["sql"]
        }
        assert read and all(rows <= 200 for rows in read.values()), (term, read)


def test_the_largest_tables_searches_read_what_they_find_not_the_table() -> None:
    """The admin's search matched each word anywhere in each field (icontains, which no index serves)
    and OR-ed the fields across joins: a search of the calls, jobs, ledger or usage read every row,
    past PTC_DB_STATEMENT_TIMEOUT on a large deployment. It now matches ids, keys and usernames whole,
    each by its index, and reads the rows it finds."""
    crowd = get_user_model().objects.create_user(username=f"crowd-{uuid.uuid4().hex[:6]}")
    for make in (_many_calls, _many_ledger_entries, _much_usage, _many_jobs):
        make(crowd)
    user = get_user_model().objects.create_user(username=f"found-{uuid.uuid4().hex[:6]}")
    toolset = Toolset.objects.create(
        key=f"rare_{uuid.uuid4().hex[:6]}", name="Rare", kind="http", owner=user, is_global=False, config={"base_url": "http://x"}
    )
    tool = Tool.objects.create(toolset=toolset, name=f"rare_{uuid.uuid4().hex[:6]}", input_schema={"type": "object"})
    job = running_job(user=user, status="completed", finished_at=timezone.now())
    first, second = job_calls(job, [{"started_at": job.created_at, "tool": tool, "toolset_key": toolset.key}] * 2)
    calls = "/admin/execution/toolcall/"
    terms = [first.call_id, job.call_id, user.username, toolset.key, tool.name]
    _searched(calls, "execution_toolcall", terms, [first.call_id, second.call_id, first.call_id, second.call_id, first.call_id])
    _searched("/admin/execution/execjob/", "execution_execjob", [str(job.pk), job.call_id, user.username], [job.call_id] * 3)
    credits_adjust(user=user, amount=5, reason="found me")
    usage = CreditUsage.objects.create(user=user, tool_call_id=first.call_id, amount=1, due_amount=1)
    _searched("/admin/billing/ledgerentry/", "billing_ledgerentry", [user.username], ["found me"])
    _searched("/admin/billing/creditusage/", "billing_creditusage", [user.username, usage.tool_call_id], [first.call_id] * 2)


def test_the_usage_chart_reads_its_thirty_days_not_the_whole_history() -> None:
    """The chart of the last 30 days' spend picked its rows by their dates (created_at__date, a cast
    of each row's time, which created_at's index does not serve): each load read every usage row
    ever written, a row a call charged. It now reads the 30 days' rows, by the index. (History
    here: 100,000 rows of 90 days ago, beside the other tests' recent ones.)"""
    user = get_user_model().objects.create_user(username=f"spent-{uuid.uuid4().hex[:6]}")
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO billing_creditusage (user_id, tool_call_id, usage_type, tool_call_meta, amount, due_amount, created_at)"
            " SELECT %s, 'ptc_old_' || md5(random()::text || g), 'tool_call', '{}'::jsonb, 1, 1, now() - interval '90 days'"
            " FROM generate_series(1, 100000) g",
            [user.pk],
        )
    CreditUsage.objects.create(user=user, tool_call_id=f"ptc_{uuid.uuid4().hex}", amount=7, due_amount=7)
    try:
        with connection.cursor() as cursor:
            cursor.execute("ANALYZE billing_creditusage")
        staff = get_user_model().objects.create_user(username=f"admin-{uuid.uuid4().hex[:6]}", is_staff=True, is_superuser=True)
        client = Client()
        client.force_login(staff)
        with CaptureQueriesContext(connection) as queries:
            page = client.get("/admin/billing/creditusage/chart/")
        assert page.status_code == 200 and f"{user.username} (7)" in page.content.decode()  # today's 7, not the old rows
        recent = CreditUsage.objects.filter(created_at__gte=timezone.now() - timedelta(days=31)).count()  # other tests' too
        read = [
            _rows_read(q["sql"], "billing_creditusage") for q in queries.captured_queries if '"billing_creditusage"' in q["sql"]
        ]
        assert read and all(rows <= recent for rows in read), (read, recent)
    finally:
        CreditUsage.objects.filter(user=user).delete()


def test_the_delete_actions_confirmation_posts_back_the_rows_it_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    """ "Select all" of the finished jobs, then the delete action: its confirmation counts the jobs
    and posts back their keys. A job that ended as the page was drawn was among the keys, read
    again, and not among the rows counted: confirmed, it was deleted, unsaid."""
    from execution.admin import ExecJobAdmin

    user = get_user_model().objects.create_user(username=f"ended-{uuid.uuid4().hex[:6]}")
    counted = running_job(user=user, status="completed", finished_at=timezone.now())
    late: list[ExecJob] = []
    counting = ExecJobAdmin.get_deleted_objects

    def counted_then_another_ends(self: ExecJobAdmin, objs: Any, request: Any) -> tuple[Any, ...]:
        deleted = counting(self, objs, request)
        late.append(running_job(user=user, status="completed", finished_at=timezone.now()))
        return deleted

    monkeypatch.setattr(ExecJobAdmin, "get_deleted_objects", counted_then_another_ends)
    staff = get_user_model().objects.create_user(username=f"admin-{uuid.uuid4().hex[:6]}", is_staff=True, is_superuser=True)
    client = Client()
    client.force_login(staff)
    data = {"action": "delete_selected", "select_across": "1", "index": "0", "_selected_action": [str(counted.pk)]}
    page = client.post(f"/admin/execution/execjob/?user__id__exact={user.pk}", data)
    assert page.status_code == 200
    posted = set(re.findall(r'name="_selected_action" value="([^"]+)"', page.content.decode()))
    assert posted == {str(counted.pk)}, posted  # before: the late job's too
    ExecJob.objects.filter(user=user).delete()


def _select_all_and_delete(client: Client, user: Any) -> Any:
    """The tool call list searched for ``user``'s calls, "Select all" of them, then the delete action."""
    one = ToolCall.objects.filter(user=user).values_list("pk", flat=True).first()
    data = {"action": "delete_selected", "select_across": "1", "index": "0", "_selected_action": [str(one)]}
    return client.post(_calls_of(user), data)


def _calls_of(user: Any) -> str:
    return f"/admin/execution/toolcall/?q={user.username}"


def test_a_delete_action_over_more_rows_than_a_statement_binds_deletes_nothing_and_says_to_narrow_the_list() -> None:
    """ "Select all" of 70,000 calls: past the 65,535 parameters PostgreSQL binds in a statement,
    which every query of the delete that named the keys chosen (one pk__in) was."""
    from ptcproject.admin_deletes import chosen_max

    user = get_user_model().objects.create_user(username=f"many-{uuid.uuid4().hex[:6]}")
    finished_calls(user=user, rows=70_000)
    staff = get_user_model().objects.create_user(username=f"admin-{uuid.uuid4().hex[:6]}", is_staff=True, is_superuser=True)
    client = Client()
    client.force_login(staff)
    try:
        answer = _select_all_and_delete(client, user)
        # Before: OperationalError (number of parameters must be between 0 and 65535), a 500.
        assert answer.status_code == 302, answer.content.decode()[-2000:]
        page = client.get(answer["Location"]).content.decode()
        assert f"Nothing was deleted: more than {chosen_max():,} tool calls were selected" in page, page[-3000:]
        assert ToolCall.objects.filter(user=user).count() == 70_000
    finally:
        with connection.cursor() as cursor:
            cursor.execute("DELETE FROM execution_toolcall WHERE user_id = %s", [user.pk])


def test_the_delete_actions_confirmation_posts_back_as_many_rows_as_it_takes_and_one_more_is_refused_first() -> None:
    """The confirmation posts back a field a row: of more than the form's limit
    (DATA_UPLOAD_MAX_NUMBER_FIELDS, with its other fields), Django refused it once confirmed, a 400.
    One row more than the action takes is refused before its confirmation, and deletes nothing; as
    many as it takes are confirmed, as a browser posts the page's form, and deleted."""
    from ptcproject.admin_deletes import chosen_max

    user = get_user_model().objects.create_user(username=f"some-{uuid.uuid4().hex[:6]}")
    finished_calls(user=user, rows=chosen_max() + 1)
    staff = get_user_model().objects.create_user(username=f"admin-{uuid.uuid4().hex[:6]}", is_staff=True, is_superuser=True)
    client = Client()
    client.force_login(staff)
    try:
        refused = _select_all_and_delete(client, user)
        assert refused.status_code == 302, refused.content.decode()[-2000:]  # before: its confirmation, then a 400
        assert "Nothing was deleted: more than" in client.get(refused["Location"]).content.decode()
        assert ToolCall.objects.filter(user=user).count() == chosen_max() + 1
        ToolCall.objects.filter(pk=ToolCall.objects.filter(user=user).values_list("pk", flat=True).first()).delete()
        page = _select_all_and_delete(client, user)
        assert page.status_code == 200, page.content.decode()[-2000:]
        form = re.search(r'<form method="post">(.*?)</form>', page.content.decode(), re.S)
        assert form, page.content.decode()[-3000:]
        fields = re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)"', form[1])
        assert len(fields) == chosen_max() + 3, len(fields)  # a key a row, its CSRF token, its action and "post"
        confirmed = client.post(_calls_of(user), urlencode(fields), content_type=FORM)
        assert confirmed.status_code == 302, confirmed.content.decode()[-2000:]
        assert not ToolCall.objects.filter(user=user).exists()
    finally:
        with connection.cursor() as cursor:
            cursor.execute("DELETE FROM execution_toolcall WHERE user_id = %s", [user.pk])


def _bulk_of(user: Any, admin_page: str) -> tuple[list[str], list[str]]:
    """Three finished rows of ``user``'s for the list at ``admin_page`` (jobs or calls), each with
    columns of a megabyte's kind (code and output; input and output); return their keys and those
    columns as their SQL names them."""
    big = "x" * 100_000
    job = running_job(user=user, status="completed", finished_at=timezone.now(), code=big, stdout=big)
    if admin_page == "execjob":
        more = [running_job(user=user, status="completed", finished_at=timezone.now(), code=big) for _ in range(2)]
        columns = [f'"execution_execjob"."{name}"' for name in ("code", "stdout", "stderr", "return_value")]
        return [str(row.pk) for row in [job, *more]], columns
    calls = job_calls(job, [{"input": {"text": big}, "output": {"text": big}, "started_at": job.created_at}] * 3)
    return [str(call.pk) for call in calls], [f'"execution_toolcall"."{name}"' for name in ("input", "output", "error")]


@pytest.mark.parametrize("admin_page", ["execjob", "toolcall"])
def test_the_delete_actions_confirmation_reads_only_what_it_shows(admin_page: str) -> None:
    """The delete action's confirmation names the rows chosen and posts back their keys: it read
    each row whole to do so, every job's code and output, every call's input and output (997 rows
    at most, each up to megabytes)."""
    user = get_user_model().objects.create_user(username=f"bulk-{uuid.uuid4().hex[:6]}")
    keys, bulky = _bulk_of(user, admin_page)
    staff = get_user_model().objects.create_user(username=f"admin-{uuid.uuid4().hex[:6]}", is_staff=True, is_superuser=True)
    client = Client()
    client.force_login(staff)
    try:
        with CaptureQueriesContext(connection) as queries:
            page = client.post(f"/admin/execution/{admin_page}/", {"action": "delete_selected", "_selected_action": keys})
        assert page.status_code == 200, page.content.decode()[-2000:]
        posted = set(re.findall(r'name="_selected_action" value="([^"]+)"', page.content.decode()))
        assert posted == set(keys)
        model = ExecJob if admin_page == "execjob" else ToolCall
        named = model.objects.filter(pk__in=keys).values_list("call_id", flat=True)
        assert all(call_id in page.content.decode() for call_id in named)  # each row named, as before
        read = [q["sql"] for q in queries.captured_queries if any(column in q["sql"] for column in bulky)]
        assert not read, read  # before: SELECT of every column of the rows chosen, twice
        confirmed = client.post(
            f"/admin/execution/{admin_page}/", {"action": "delete_selected", "_selected_action": keys, "post": "yes"}
        )
        assert confirmed.status_code == 302, confirmed.content.decode()[-2000:]
        assert not model.objects.filter(pk__in=keys).exists()
    finally:
        ExecJob.objects.filter(user=user).delete()
