"""Hostile tests of the admin's pages: what one page load reads, however big the rows it lists."""

import re
import time
import tracemalloc
import uuid
from datetime import timedelta
from typing import Any

from django.contrib.auth import get_user_model
from django.contrib.auth.models import User
from django.test import Client
from django.utils import timezone

from execution.models import ExecJob, ToolCall
from tests.factories import demo_call, job_calls, running_job

MB = 1024 * 1024
# A list page shows 100 rows of short columns: a few MB of Python for them is plenty.
LIST_PAGE_BUDGET = 20 * MB


def _staff_client() -> Client:
    staff = get_user_model().objects.create_user(username=f"hh-admin-{uuid.uuid4().hex[:6]}", is_staff=True, is_superuser=True)
    client = Client()
    client.force_login(staff)
    return client


def _page_held(client: Client, url: str) -> tuple[Any, int]:
    """Load ``url`` twice, the first to warm up (the session, content types, caches); return the
    second answer and the most memory the Python heap held above its start while it was made."""
    client.get(url)
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        start, _ = tracemalloc.get_traced_memory()
        response = client.get(url)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return response, peak - start


def _user() -> User:
    return get_user_model().objects.create_user(username=f"hh-{uuid.uuid4().hex[:8]}")


def _lists_each_job_once(client: Client, url: str, jobs: list[ExecJob], rows: str) -> None:
    """The list page at ``url`` names the first of ``jobs`` once, one row of ``rows`` for each,
    and held at most LIST_PAGE_BUDGET to draw them."""
    response, peak = _page_held(client, url)
    assert response.status_code == 200
    assert response.content.decode().count(jobs[0].call_id) == 1
    assert peak < LIST_PAGE_BUDGET, f"{url} held {peak / MB:.0f} MB to show {rows}"


def _jobs_that_printed(user: User) -> list[ExecJob]:
    """100 finished jobs of ``user``, ``job 0`` to ``job 99``, that each printed the default cap:
    1 MB of stdout and 1 MB of stderr."""
    now = timezone.now()
    return ExecJob.objects.bulk_create(
        ExecJob(
            user=user,
            code="print('x' * 10**6)",
            toolsets=["demo"],
            timeout_seconds=60,
            status="completed",
            title=f"job {i}",
            started_at=now - timedelta(seconds=2),
            finished_at=now,
            stdout="x" * MB,
            stderr="y" * MB,
        )
        for i in range(100)
    )


def test_the_job_list_does_not_read_every_jobs_output() -> None:
    """100 jobs that each printed the default cap (1 MB of stdout, 1 MB of stderr): the list page
    shows their ids, users, statuses and titles, and must not read 200 MB of output to do it."""
    client = _staff_client()
    user = _user()
    _jobs_that_printed(user)
    url = f"/admin/execution/execjob/?user__id__exact={user.pk}"
    response, peak = _page_held(client, url)
    assert response.status_code == 200
    assert response.content.decode().count("job 9") == 11  # job 9, job 90..99: the rows are there
    assert peak < LIST_PAGE_BUDGET, f"the job list page held {peak / MB:.0f} MB to show 100 rows"


def test_the_tool_call_list_does_not_read_every_calls_input_and_output() -> None:
    """100 calls with an input and an output of 1 MB each (the default cap): the list shows their
    ids, tools, statuses and credits, and must not read 200 MB of JSON to do it."""
    client = _staff_client()
    user = _user()
    now = timezone.now()
    ToolCall.objects.bulk_create(
        ToolCall(
            call_id=f"standalone_{uuid.uuid4().hex}",
            type="standalone",
            user=user,
            toolset_key="demo",
            tool_name="echo",
            input={"value": "v" * MB},
            output="v" * MB,
            status="completed",
            started_at=now,
            finished_at=now,
        )
        for _ in range(100)
    )
    url = f"/admin/execution/toolcall/?q={user.username}"
    response, peak = _page_held(client, url)
    assert response.status_code == 200
    assert response.content.decode().count("standalone_") >= 100
    assert peak < LIST_PAGE_BUDGET, f"the tool call list page held {peak / MB:.0f} MB to show 100 rows"


def test_a_jobs_page_does_not_read_every_calls_whole_input_and_output() -> None:
    """A job within its limits: 1,000 calls (max_tool_calls) whose outputs add up to 64 MB
    (PTC_MAX_JOB_TOOL_BYTES), each a list of products as catalog_search returns. Its page draws the
    calls aggregated and shows a preview of a call's input and output at most: it must not read
    and decode every byte of them."""
    client = _staff_client()
    user = _user()
    start = timezone.now() - timedelta(minutes=1)
    job = running_job(user=user, status="completed", started_at=start, finished_at=start + timedelta(seconds=30))
    product = {"id": 1, "name": "Gold watch", "category": "watches", "price": 100, "stock": 3}
    products = [product] * (64 * 1024 // 80)  # about 64 KB of JSON per call
    job_calls(
        job,
        (
            {
                "tool_name": "catalog_search",
                "input": {"query": "watch"},
                "output": products,
                "started_at": start + timedelta(milliseconds=i * 20),
                "finished_at": start + timedelta(milliseconds=i * 20 + 15),
            }
            for i in range(1000)
        ),
    )
    url = f"/admin/execution/execjob/{job.pk}/change/"
    response, peak = _page_held(client, url)
    assert response.status_code == 200
    assert 'data-aggregated="true"' in response.content.decode()
    assert peak < 50 * MB, f"the job's page held {peak / MB:.0f} MB to draw 1,000 calls"

    # Drawn as bars, a few of the calls: a small input is shown whole, as before; a big output's
    # preview says how much more there is.
    ToolCall.objects.filter(exec_job=job).exclude(pk__in=ToolCall.objects.filter(exec_job=job)[:3]).delete()
    html = client.get(url).content.decode()
    assert 'data-aggregated="true"' not in html
    assert '"{\\n \\"query\\": \\"watch\\"\\n}"' in html
    assert "more characters)" in html
    assert "input: {&quot;query&quot;: &quot;watch&quot;}" in html  # a bar's title


def test_a_key_is_revoked_in_the_admin_never_deleted_with_its_audit_trail() -> None:
    """A key's events say who made it, changed its expiry and revoked it, and are kept for good:
    the API revokes and never deletes. The admin's delete erased the key and every event of it,
    and recorded nothing."""
    from ptcproject.accounts.models import ApiKey, ApiKeyEvent
    from ptcproject.accounts.services import api_key_create

    client = _staff_client()
    key, _ = api_key_create(user=_user(), name="ci", source="api")
    assert ApiKeyEvent.objects.filter(key=key, action="created").exists()
    for url, data in (
        (f"/admin/accounts/apikey/{key.pk}/delete/", {"post": "yes"}),
        ("/admin/accounts/apikey/", {"action": "delete_selected", "_selected_action": [key.pk], "post": "yes"}),
    ):
        client.post(url, data)
        assert ApiKey.objects.filter(pk=key.pk).exists(), url
        assert ApiKeyEvent.objects.filter(key=key, action="created").exists(), url
    # Revoking is the way, and it is audited.
    client.post("/admin/accounts/apikey/", {"action": "revoke", "_selected_action": [key.pk]})
    key.refresh_from_db()
    assert key.revoked_at is not None
    assert ApiKeyEvent.objects.filter(key=key, action="revoked", details__source="admin").exists()


def test_the_usage_chart_draws_every_users_credits_however_many_users() -> None:
    """Per user, a deployment has far more than the chart's colours. A day's bar is the credits
    spent that day, all of them: a series past the 90th was left out of the bars and the legend,
    while the axis still counted it (100 users spending 1 credit each drew 90 credits)."""
    from billing.charts import stacked_bars_svg

    series = {f"user-{i:03}": [1, 2] for i in range(100)}
    svg = stacked_bars_svg(labels=["2025-01-01", "2025-01-02"], series=series)
    drawn = [int(n) for n in re.findall(r"<title>2025-01-01 · [^<]*: (\d+) credits</title>", svg)]
    assert sum(drawn) == 100, f"the day's bar draws {sum(drawn)} of its 100 credits"
    legend = re.findall(r"<text [^>]*>([^<]*) \((\d+)\)</text>", svg)
    assert sum(int(total) for _, total in legend) == 300, legend[-3:]


def test_the_policy_page_does_not_read_its_whole_history() -> None:
    """Every edit of the policy is kept (PolicyChange), the allowlist's old and new lists in each:
    a rollout that adds its users a few at a time, 1,000 edits of a 2,000-name allowlist, is 60 MB
    of history. The policy's page shows the latest edits, not every one ever made."""
    from ptcproject.policy.models import PolicyChange
    from ptcproject.policy.selectors import POLICY_PK
    from ptcproject.policy.services import policy_ensure

    client = _staff_client()
    policy_ensure()
    names = [f"rollout-user-{i:05}" for i in range(2000)]
    made = PolicyChange.objects.bulk_create(
        PolicyChange(policy_id=POLICY_PK, changes={"user_allowlist": [names[: 1000 + i], names[: 1001 + i]]}) for i in range(1000)
    )
    try:
        url = f"/admin/policy/policy/{POLICY_PK}/change/"
        response, peak = _page_held(client, url)
        assert response.status_code == 200
        assert peak < 50 * MB, f"the policy's page held {peak / MB:.0f} MB"
        assert len(response.content) < 10 * MB, f"the policy's page is {len(response.content) / MB:.0f} MB of HTML"
        # The whole history is still there to read, a page at a time.
        listed = client.get("/admin/policy/policychange/")
        assert listed.status_code == 200
        total = re.search(r"([\d,]+) policy changes", listed.content.decode())
        assert total is not None and int(total.group(1).replace(",", "")) >= 1000
    finally:
        PolicyChange.objects.filter(pk__in=[change.pk for change in made]).delete()


def test_a_managed_containers_page_does_not_read_every_call_it_ever_made() -> None:
    """A managed container's job runs until cancelled, and has no max_tool_calls: its calls add up
    without end. Its page draws them aggregated; one load must not hold every call ever made, each
    with its tool and toolset rows."""
    client = _staff_client()
    user = _user()
    start = timezone.now() - timedelta(hours=1)
    job = running_job(user=user, container_id=f"cntr_{uuid.uuid4().hex[:12]}", toolsets=[], timeout_seconds=0, started_at=start)
    template = demo_call(user=user, job=job, started_at=start, status="completed", finished_at=start, output=2)
    count = 20_000
    job_calls(
        job,
        (
            {
                "tool_name": "add",
                "tool_id": template.tool_id,
                "input": {"a": 1, "b": 1},
                "output": 2,
                "started_at": start + timedelta(milliseconds=i * 100),
                "finished_at": start + timedelta(milliseconds=i * 100 + 20),
            }
            for i in range(count)
        ),
    )
    url = f"/admin/execution/execjob/{job.pk}/change/"
    started = time.monotonic()
    response, peak = _page_held(client, url)
    took = time.monotonic() - started
    assert response.status_code == 200
    assert peak < 50 * MB, f"the container's page held {peak / MB:.0f} MB for {count:,} calls ({took:.1f} s)"
    html = response.content.decode()
    assert (
        f"the first 5000 of the job&#x27;s {count + 1} calls" in html or f"the first 5000 of the job's {count + 1} calls" in html
    )
    assert f"?exec_job={job.pk}" in html  # all of them, a page at a time


XSS = '<img src=x onerror="alert(1)"><script>alert(2)</script>'


def test_what_users_and_toolset_authors_write_is_text_on_every_staff_page() -> None:
    """A job's title, code, output and error, a call's input, output, error and approval reason, a
    tool's name and description (an MCP server's), a key's name and a toolset key in the usage
    chart: staff read them all in the admin, where each must stay text, never markup."""
    from billing.models import CreditUsage
    from ptcproject.accounts.services import api_key_create
    from tools.models import Tool, Toolset

    client = _staff_client()
    user = get_user_model().objects.create_user(username=f"hh-{uuid.uuid4().hex[:6]}")
    toolset = Toolset.objects.create(key=f"x{uuid.uuid4().hex[:8]}", name=XSS, kind="http", owner=user, description=XSS)
    tool = Tool.objects.create(toolset=toolset, name="evil", remote_name=XSS, description=XSS, input_schema={"title": XSS})
    now = timezone.now()
    job = ExecJob.objects.create(
        user=user,
        title=XSS,
        code=XSS,
        toolsets=[toolset.key],
        timeout_seconds=30,
        status="failed",
        started_at=now,
        finished_at=now,
        stdout=XSS,
        stderr=XSS,
        return_value=XSS,
        error={"type": XSS, "message": XSS, "traceback": XSS},
    )
    waiting = demo_call(user=user, job=job, input={XSS: XSS}, status="awaiting_approval")
    done = demo_call(user=user, job=job, input={"v": XSS}, output={XSS: XSS}, status="completed", finished_at=now)
    ToolCall.objects.filter(pk=done.pk).update(decision="denied", decision_reason=XSS, decided_at=now)
    key, _ = api_key_create(user=user, name=XSS[:100], source="api")
    CreditUsage.objects.create(
        user=user, tool_call_id=f"x_{uuid.uuid4().hex}", tool_call_meta={"toolsetKey": XSS}, amount=1, due_amount=1
    )
    pages = [
        f"/admin/execution/execjob/{job.pk}/change/",
        f"/admin/execution/execjob/?q={job.call_id}",
        f"/admin/execution/toolcall/{waiting.pk}/change/",
        f"/admin/execution/toolcall/{done.pk}/change/",
        f"/admin/execution/toolcall/?q={user.username}",
        f"/admin/tools/toolset/{toolset.pk}/change/",
        f"/admin/tools/tool/{tool.pk}/change/",
        f"/admin/tools/tool/?q={toolset.key}",
        f"/admin/accounts/apikey/{key.pk}/change/",
        f"/admin/accounts/apikey/?q={user.username}",
        "/admin/billing/creditusage/chart/",
    ]
    for page in pages:
        response = client.get(page)
        assert response.status_code == 200, page
        html = response.content.decode()
        assert "<script>alert(2)" not in html and "<img src=x" not in html, page


def test_the_job_and_session_lists_do_not_read_every_user_for_their_filters() -> None:
    """The lists of jobs and of sessions filtered by user: their sidebar listed every user of the
    deployment, each a row read and a link drawn, on every load; so did the forms that add a key
    or a toolset (or change a toolset), in their owner's select. 50,000 users are a few MB of HTML
    a load (the toolset's form took 20 s to draw)."""
    from tools.models import Toolset

    get_user_model().objects.bulk_create(get_user_model()(username=f"hh-many-{uuid.uuid4().hex}") for _ in range(50_000))
    client = _staff_client()
    owned = Toolset.objects.create(key=f"t{uuid.uuid4().hex}", name="mine", kind="http", owner=_user(), is_global=False)
    for url in (
        "/admin/policy/policy/try/",
        "/admin/accounts/apikey/add/",
        "/admin/tools/toolset/add/",
        f"/admin/tools/toolset/{owned.pk}/change/",
        "/admin/execution/execsession/",
        "/admin/execution/execjob/?status__exact=completed",
    ):
        response, peak = _page_held(client, url)
        assert response.status_code == 200
        assert peak < LIST_PAGE_BUDGET, f"{url} held {peak / MB:.0f} MB"
        assert len(response.content) < 1 * MB, f"{url} is {len(response.content) / MB:.1f} MB of HTML"
    # The try page's user is searched for instead, as the key's and the toolset's owner are.
    for app, model, field in (
        ("accounts", "usersettings", "user"),
        ("accounts", "apikey", "user"),
        ("tools", "toolset", "owner"),
    ):
        found = client.get(
            "/admin/autocomplete/", {"app_label": app, "model_name": model, "field_name": field, "term": "hh-many-"}
        )
        assert found.status_code == 200 and found.json()["results"], (app, model)
    owned.delete()


def test_state_changing_admin_and_api_requests_need_the_csrf_token_of_a_staff_session() -> None:
    """A staff member's browser, signed in to the admin, must not approve a call, cancel a job,
    grant credits or revoke a key because another site posted to it."""
    from billing.models import LedgerEntry

    staff = get_user_model().objects.create_user(username=f"hh-csrf-{uuid.uuid4().hex[:6]}", is_staff=True, is_superuser=True)
    client = Client(enforce_csrf_checks=True)
    client.force_login(staff)
    user = _user()
    job = ExecJob.objects.create(user=user, code="", toolsets=["demo"], timeout_seconds=30, status="running")
    call = demo_call(user=user, job=job, status="awaiting_approval")
    posts = [
        (f"/admin/execution/execjob/{job.pk}/decide/?call_id={call.call_id}", {"approve": "1"}),
        (f"/api/v1/tool-calls/{call.call_id}/approval", {"approve": True}),
        (f"/api/v1/exec/{job.pk}/cancel", {}),
        ("/api/v1/billing/credits", {"username": user.username, "amount": 1000, "reason": "csrf"}),
    ]
    for url, data in posts:
        if url.startswith("/api/"):
            response = client.post(url, data, content_type="application/json")
        else:
            response = client.post(url, data)
        assert response.status_code == 403, (url, response.status_code)
    call.refresh_from_db()
    job.refresh_from_db()
    assert (call.status, call.decision, job.status) == ("awaiting_approval", "", "running")
    assert not LedgerEntry.objects.filter(account__user=user).exists()


def test_the_usage_chart_draws_its_30_days_whatever_else_the_usage_rows_hold() -> None:
    """Usage rows are stamped by the database's clock (the settle's now()), the chart's days by the
    web's. A row the database dates after the web's today (a clock ahead, around midnight) made
    the chart page fail (500) for everyone; it draws its 30 days, and such a row waits for its day."""
    from billing.models import CreditUsage

    client = _staff_client()
    user = _user()
    usage = CreditUsage.objects.create(user=user, tool_call_id=f"x_{uuid.uuid4().hex}", amount=3, due_amount=3)
    CreditUsage.objects.filter(pk=usage.pk).update(created_at=timezone.now() + timedelta(days=1))
    try:
        response = client.get("/admin/billing/creditusage/chart/")
        assert response.status_code == 200
        assert response.content.decode().count('aria-label="credits per day"') == 2
    finally:
        CreditUsage.objects.filter(pk=usage.pk).delete()


def test_staff_pages_do_not_list_every_toolset_any_user_made() -> None:
    """Any user may make toolsets of their own over the API, as many as they like. The admin's tool
    and discount lists filtered by toolset, and the forms that add a tool or a discount, or try a
    decision, offered every toolset of every user: each page load read and drew all of them."""
    from tools.models import Toolset

    owner = _user()
    Toolset.objects.bulk_create(
        Toolset(key=f"t{uuid.uuid4().hex}", name="mine", kind="http", owner=owner, is_global=False) for _ in range(20_000)
    )
    client = _staff_client()
    heavy = []
    try:
        for url in (
            "/admin/tools/tool/?enabled__exact=1",
            "/admin/tools/tool/add/",
            "/admin/billing/discount/",
            "/admin/billing/discount/add/",
            "/admin/policy/policy/try/",
        ):
            response, peak = _page_held(client, url)
            assert response.status_code == 200, url
            if peak >= LIST_PAGE_BUDGET or len(response.content) >= 1 * MB:
                heavy.append(f"{url}: {peak / MB:.0f} MB held, {len(response.content) / MB:.1f} MB of HTML")
        assert not heavy, heavy
    finally:
        Toolset.objects.filter(owner=owner).delete()


def test_the_tool_call_list_does_not_list_every_toolset_key_ever_called() -> None:
    """The tool call list filtered by toolset key: its sidebar was every distinct key in the whole
    table of calls (a scan of every call, each load), and users name their own toolsets freely."""
    user = _user()
    now = timezone.now()
    ToolCall.objects.bulk_create(
        ToolCall(
            call_id=f"standalone_{uuid.uuid4().hex}",
            type="standalone",
            user=user,
            toolset_key=f"t{uuid.uuid4().hex}",
            tool_name="x",
            input={},
            status="failed",
            started_at=now,
            finished_at=now,
        )
        for _ in range(20_000)
    )
    client = _staff_client()
    url = "/admin/execution/toolcall/?status__exact=completed"
    client.get(url)
    response = client.get(url)
    assert response.status_code == 200
    assert len(response.content) < 1 * MB, f"the tool call list is {len(response.content) / MB:.1f} MB of HTML"
    # A user's calls are found by searching for their username (a toolset's, by its key, through
    # its tools: these calls have none).
    call_id = ToolCall.objects.filter(user=user).order_by("-id").values_list("call_id", flat=True).first()
    assert call_id is not None and call_id in client.get("/admin/execution/toolcall/", {"q": user.username}).content.decode()


def test_the_key_list_does_not_read_the_output_of_every_keys_job() -> None:
    """Every job has a key of its own, listed with its job: the list joined each key's job whole,
    its code and output (1 MB of stdout, 1 MB of stderr at the default caps) to show its call id."""
    from ptcproject.accounts.services import api_key_create

    client = _staff_client()
    user = _user()
    jobs = _jobs_that_printed(user)
    for job in jobs:
        api_key_create(user=user, exec_job=job)
    url = f"/admin/accounts/apikey/?q={user.username}"
    _lists_each_job_once(client, url, jobs, "100 keys")


def test_the_file_list_does_not_read_the_output_of_every_files_job() -> None:
    """A job's output files are listed with their job: the list joined each file's job whole, its
    code and output, to show its call id."""
    from execution.models import WorkFile

    client = _staff_client()
    user = _user()
    jobs = _jobs_that_printed(user)
    WorkFile.objects.bulk_create(
        WorkFile(exec_job=job, kind="output", path=f"hh-{user.username}.txt", content=b"1", size=1) for job in jobs
    )
    url = f"/admin/execution/workfile/?exec_job__in={','.join(str(job.pk) for job in jobs)}"  # a path is not searched
    _lists_each_job_once(client, url, jobs, "100 files")


def test_the_admin_deletes_no_job_or_call_that_has_not_ended() -> None:
    """A job still running deleted in the admin took its calls' records with it: a call a tools
    worker ran was then never charged (its record is what it is charged by), and the worker
    recorded the job's end into nothing. The admin deletes such a job or call neither from its
    page nor by the list's action, and says why; a finished one it deletes as before."""
    client = _staff_client()
    user = _user()
    job = running_job(user=user)
    call = demo_call(user=user, job=job)  # executing
    done = running_job(user=user, status="completed", finished_at=timezone.now())
    for url, data in (
        (f"/admin/execution/execjob/{job.pk}/delete/", {"post": "yes"}),
        ("/admin/execution/execjob/", {"action": "delete_selected", "_selected_action": [job.pk], "post": "yes"}),
        (f"/admin/execution/toolcall/{call.pk}/delete/", {"post": "yes"}),
        ("/admin/execution/toolcall/", {"action": "delete_selected", "_selected_action": [call.pk], "post": "yes"}),
    ):
        page = client.post(url, data)
        assert ExecJob.objects.filter(pk=job.pk).exists() and ToolCall.objects.filter(pk=call.pk).exists(), url
        assert call.call_id in page.content.decode(), url  # named as what keeps it
    assert (
        f"job {job.call_id} (running: cancel it first)"
        in client.get(f"/admin/execution/execjob/{job.pk}/delete/").content.decode()
    )
    client.post(f"/admin/execution/execjob/{done.pk}/delete/", {"post": "yes"})
    assert not ExecJob.objects.filter(pk=done.pk).exists()
