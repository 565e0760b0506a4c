"""Tenant quotas on the real stack: past a quota POST /exec answers 429 rate_limited with
Retry-After and creates nothing, and one user flooding the fleet does not starve another."""

import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
from django.contrib.auth import get_user_model

from execution.models import ExecJob, ToolCall
from ptcproject.accounts.models import UserSettings
from ptcproject.policy.selectors import policy_get, quotas_for
from tests.conftest import Api
from tests.stack import Stack

SLEEP = "import time\ntime.sleep(4)"


def _quota(api: Api, **fields: int) -> None:
    UserSettings.objects.create(user=get_user_model().objects.get(username=api.username), **fields)


def _flood(api: Api, count: int, code: str = SLEEP) -> list[httpx.Response]:
    """Submit ``count`` jobs at once, from as many threads."""
    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(lambda _: api.post("/api/v1/exec", json={"code": code, "wait": 0}), range(count)))


def _queue_ms(api: Api) -> float:
    """Run a short job for ``api`` and return how long it waited for an exec worker."""
    job = api.run("print('hi')", wait=60)
    assert job["status"] == "completed"
    return float(ExecJob.objects.get(pk=job["id"]).timings["queue_ms"])


def _wait_idle(apis: list[Api], seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    users = [a.username for a in apis]
    while ExecJob.objects.filter(user__username__in=users, status__in=("queued", "running")).exists():
        assert time.monotonic() < deadline
        time.sleep(0.2)


def test_a_flooding_user_gets_429_and_does_not_starve_another(make_api: Callable[..., Api]) -> None:
    flooder, victim = make_api(), make_api()
    _quota(flooder, max_concurrent_jobs=2)
    answers = _flood(flooder, 10)
    accepted = [r for r in answers if r.status_code == 201]
    refused = [r for r in answers if r.status_code != 201]
    assert len(accepted) == 2, [r.status_code for r in answers]  # counted under the user's lock
    for response in refused:
        assert response.status_code == 429
        body = response.json()["error"]
        assert body["code"] == "rate_limited"
        assert body["details"]["quota"] == "concurrent_jobs" and body["details"]["limit"] == 2
        assert int(response.headers["Retry-After"]) >= 1
    assert ExecJob.objects.filter(user__username=flooder.username).count() == 2  # nothing half-made
    # The flooder holds 2 of the exec worker's 6 threads: the other user's job starts at once.
    assert _queue_ms(victim) < 2000
    _wait_idle([flooder])
    assert flooder.post("/api/v1/exec", json={"code": "1", "wait": 0}).status_code == 201  # a slot again


def test_without_a_quota_the_same_flood_makes_others_wait(make_api: Callable[..., Api]) -> None:
    """The control: the flood that the quota above absorbs holds every exec thread without it."""
    flooder, victim = make_api(), make_api()
    answers = _flood(flooder, 10)
    assert all(r.status_code == 201 for r in answers)
    time.sleep(1)  # the worker has taken its 6
    assert _queue_ms(victim) > 1000
    _wait_idle([flooder], seconds=60)


def test_jobs_per_minute_says_when_to_retry(make_api: Callable[..., Api]) -> None:
    api = make_api()
    _quota(api, max_jobs_per_minute=3)
    for _ in range(3):
        assert api.post("/api/v1/exec", json={"code": "1", "wait": 0}).status_code == 201
    refused = api.post("/api/v1/exec", json={"code": "1", "wait": 0})
    assert refused.status_code == 429
    assert refused.json()["error"]["details"]["quota"] == "jobs_per_minute"
    assert 50 <= int(refused.headers["Retry-After"]) <= 60  # when the first of the three leaves the minute


def test_tool_calls_in_flight_are_capped_per_job_and_at_submission(make_api: Callable[..., Api]) -> None:
    api = make_api()
    _quota(api, max_concurrent_tool_calls=1)
    job = api.run("from ptc_tools.demo import Demo\nDemo.sleep(ms=3000)", toolsets=["demo"], wait=0)
    assert ExecJob.objects.get(pk=job["id"]).limits["max_parallel_tool_calls"] == 1
    deadline = time.monotonic() + 20
    while True:
        refused = api.post("/api/v1/exec", json={"code": "1", "wait": 0})
        if refused.status_code == 429:
            break
        assert refused.status_code == 201
        assert time.monotonic() < deadline, "the call in flight never counted"
        time.sleep(0.1)
    assert refused.json()["error"]["details"]["quota"] == "concurrent_tool_calls"
    _wait_idle([api])
    assert api.post("/api/v1/exec", json={"code": "1", "wait": 0}).status_code == 201


def test_a_call_still_in_the_queue_counts_as_in_flight(api: Api) -> None:
    from execution.services.calls import tool_call_build, tool_calls_reserve
    from tests.factories import running_job
    from tools.models import Tool

    _quota(api, max_concurrent_tool_calls=1)
    user = get_user_model().objects.get(username=api.username)
    job = running_job(user=user)
    tool = Tool.objects.select_related("toolset").get(toolset__key="demo", toolset__owner=None, name="add")
    # As a job's bridge sends a call to a tools worker: its price held, no row until a worker claims it.
    call = tool_call_build(
        call_id=f"ptc_{uuid.uuid4().hex}", user=user, job=job, toolset="demo", tool="add", arguments={}, found=tool
    )
    assert tool_calls_reserve(calls=[(call.call_id, tool)], user=user, job=job) == {}
    refused = api.post("/api/v1/exec", json={"code": "1", "wait": 0})
    assert refused.status_code == 429 and refused.json()["error"]["details"]["quota"] == "concurrent_tool_calls", refused.text
    ExecJob.objects.filter(pk=job.pk).update(status="cancelled")
    from billing.services import credits_release

    credits_release(tool_call_id=call.call_id)  # never taken: its job's end gives its price back
    assert api.post("/api/v1/exec", json={"code": "1", "wait": 0}).status_code == 201


def test_a_users_own_quota_overrides_the_policys(api: Api) -> None:
    user = get_user_model().objects.get(username=api.username)
    policy: Any = policy_get()
    policy.max_concurrent_jobs, policy.max_concurrent_tool_calls, policy.max_jobs_per_minute = 5, 40, 0
    assert quotas_for(policy=policy, user=user).concurrent_jobs == 5
    assert quotas_for(policy=policy, user=user).parallel_cap() == 8  # 5 jobs x 8 calls stay within 40
    UserSettings.objects.create(user=user, max_concurrent_jobs=0, max_jobs_per_minute=7)
    quotas = quotas_for(policy=policy, user=user)
    assert (quotas.concurrent_jobs, quotas.concurrent_tool_calls, quotas.jobs_per_minute) == (0, 40, 7)
    assert quotas.parallel_cap() == 40


def test_an_open_session_counts_against_the_jobs_at_once_quota(api: Api) -> None:
    _quota(api, max_concurrent_jobs=2)
    first = api.post("/api/v1/sessions", json={"toolsets": ["demo"]})
    second = api.post("/api/v1/sessions", json={"toolsets": ["demo"]})
    assert first.status_code == 201 and second.status_code == 201, (first.text, second.text)
    # Two open sessions hold two sandboxes: a third session, or a job of its own, is past the quota.
    third = api.post("/api/v1/sessions", json={"toolsets": ["demo"]})
    assert third.status_code == 429 and third.json()["error"]["code"] == "rate_limited", third.text
    alone = api.post("/api/v1/exec", json={"code": "1", "wait": 0})
    assert alone.status_code == 429, alone.text
    # A job in an open session takes that session's place.
    inside = api.run("6 * 7", session=first.json()["id"])
    assert inside["status"] == "completed" and inside["return_value"] == 42, inside
    assert api.http.delete(f"/api/v1/sessions/{second.json()['id']}").status_code == 200
    _wait_idle([api])
    assert api.post("/api/v1/exec", json={"code": "1", "wait": 0}).status_code == 201


def test_a_managed_containers_job_takes_none_of_the_jobs_at_once_quota(api: Api) -> None:
    """A managed container's job stays running for as long as its container may call back (it runs
    no code here, and holds no sandbox or worker): it must not use up the user's quota for good."""
    _quota(api, max_concurrent_jobs=1)
    container = f"container_{uuid.uuid4().hex[:12]}"
    caller = {"type": "code_execution_20260120", "tool_id": "srvtoolu_1"}
    body = {"toolset": "demo", "tool": "echo", "arguments": {"value": 1}, "caller": caller, "container_id": container}
    called = api.post("/api/v1/tools/execute", json=body)
    assert called.status_code == 200 and called.json()["status"] == "completed", called.text
    assert ExecJob.objects.filter(container_id=container, status="running").exists()
    job = api.run("6 * 7")
    assert job["status"] == "completed" and job["return_value"] == 42, job


def _execute(api: Api, tool: str = "echo", container: str = "", **arguments: Any) -> httpx.Response:
    body: dict[str, Any] = {"toolset": "demo", "tool": tool, "arguments": arguments or {"value": 1}}
    if container:
        body.update(container_id=container, caller={"type": "code_execution_20260120", "tool_id": "srvtoolu_1"})
    return api.post("/api/v1/tools/execute", json=body)


def test_tools_execute_is_held_to_the_tool_calls_in_flight_quota(api: Api) -> None:
    """A standalone call, or a managed container's, is held to the user's quota of calls in flight as
    a job's submission is: past it, 429 rate_limited with Retry-After, and nothing recorded or made."""
    _quota(api, max_concurrent_tool_calls=2)
    user = get_user_model().objects.get(username=api.username)
    balance = api.get("/api/v1/billing/balance").json()["balance"]
    # Six at once: counted one by one under the user's lock, so exactly two run.
    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda _: _execute(api, "sleep", ms=2000), range(6)))
    assert sorted(r.status_code for r in answers) == [200, 200, 429, 429, 429, 429], [r.text for r in answers]
    for refused in (r for r in answers if r.status_code == 429):
        error = refused.json()["error"]
        assert error["code"] == "rate_limited", error
        assert error["details"] == {"quota": "concurrent_tool_calls", "limit": 2, "retry_after": 2}
        assert refused.headers["Retry-After"] == "2"
    assert ToolCall.objects.filter(user=user).count() == 2  # nothing recorded of the refused
    assert api.get("/api/v1/billing/balance").json()["balance"] == balance - 2  # nor charged
    # With two in flight, a container's first call is refused too, and makes no job.
    with ThreadPoolExecutor(2) as pool:
        running = [pool.submit(_execute, api, "sleep", ms=3000) for _ in range(2)]
        deadline = time.monotonic() + 10
        while ToolCall.objects.filter(user=user, status="executing").count() < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        container = f"container_{uuid.uuid4().hex[:12]}"
        refused = _execute(api, container=container)
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limited", refused.text
        assert int(refused.headers["Retry-After"]) >= 1
        assert not ExecJob.objects.filter(container_id=container).exists()
        assert all(r.result().status_code == 200 for r in running)
    # Under the quota again: both kinds run.
    assert _execute(api).status_code == 200
    called = _execute(api, container=container)
    assert called.status_code == 200 and called.json()["status"] == "completed", called.text
    assert ExecJob.objects.filter(container_id=container, status="running").exists()


def test_a_user_may_open_at_most_their_bound_of_containers(api: Api) -> None:
    """A managed container's job is made by its first call, and container ids are the client's to
    choose: past PTC_MAX_CONTAINERS_PER_USER (16 here) open, a new container's first call is refused."""
    containers = [f"container_{uuid.uuid4().hex[:12]}" for _ in range(17)]
    for container in containers[:16]:
        assert _execute(api, container=container).status_code == 200
    refused = _execute(api, container=containers[16])
    assert refused.status_code == 429, refused.text
    error = refused.json()["error"]
    assert error["code"] == "rate_limited" and "PTC_MAX_CONTAINERS_PER_USER" in error["message"], error
    assert error["details"]["quota"] == "containers" and error["details"]["limit"] == 16
    # The one idle longest is closed by the reaper an hour after its call (a round after).
    assert 3590 <= int(refused.headers["Retry-After"]) <= 3602
    assert not ExecJob.objects.filter(container_id=containers[16]).exists()
    assert ToolCall.objects.filter(user__username=api.username).count() == 16  # nothing recorded of it
    # The containers open still call; cancelling the job of one makes room for a new one.
    assert _execute(api, container=containers[0]).status_code == 200
    job = ExecJob.objects.get(container_id=containers[0])
    assert api.post(f"/api/v1/exec/{job.pk}/cancel").status_code == 200
    called = _execute(api, container=containers[16])
    assert called.status_code == 200 and called.json()["status"] == "completed", called.text


def _unused_since(container: str, *, hours: float) -> ExecJob:
    """Make the container's job, and its calls, look as if last used ``hours`` ago (not their claims:
    a claim that old is a call whose tool never returned, for the reaper)."""
    from datetime import timedelta

    from django.utils import timezone

    then = timezone.now() - timedelta(hours=hours)
    job = ExecJob.objects.get(container_id=container)
    ExecJob.objects.filter(pk=job.pk).update(started_at=then, created_at=then, last_call_at=then)
    ToolCall.objects.filter(exec_job=job).update(started_at=then)
    ToolCall.objects.filter(exec_job=job, finished_at__isnull=False).update(finished_at=then)
    return job


def _job_status_after(job: ExecJob, seconds: float, until: str = "") -> str:
    """The job's status once it is ``until``, or after ``seconds`` (the reaper runs every second here)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        status = ExecJob.objects.values_list("status", flat=True).get(pk=job.pk)
        if status == until:
            return status
        time.sleep(0.2)
    return ExecJob.objects.values_list("status", flat=True).get(pk=job.pk)


def test_an_idle_containers_job_is_closed_by_the_reaper_and_its_container_refused(stack: Stack, api: Api) -> None:
    """A container's job with no call for PTC_CONTAINER_IDLE_SECONDS (an hour) is closed by the
    reaper: it ends completed, its exec_end out and counted, and its container's next call is 409."""
    from tests.execution.client_loop import sse_events
    from tests.test_metrics import scrape, value

    container = f"container_{uuid.uuid4().hex[:12]}"
    assert _execute(api, container=container).status_code == 200
    before = value(scrape(stack), "ptc_jobs_finished_total", status="completed")
    job = _unused_since(container, hours=2)
    assert _job_status_after(job, 15, until="completed") == "completed"
    shown = api.get(f"/api/v1/exec/{job.pk}").json()
    assert shown["status"] == "completed" and shown["success"] is True and shown["finished_at"], shown
    assert len(shown["tool_calls"]) == 1
    events = list(sse_events(api, str(job.pk), timeout=15))
    assert events[-1][0] == "exec_end" and events[-1][1]["status"] == "completed", events[-1]
    assert value(scrape(stack), "ptc_jobs_finished_total", status="completed") > before
    refused = _execute(api, container=container)
    assert refused.status_code == 409, refused.text
    assert refused.json()["error"]["code"] == "job_finished" and "has ended" in refused.json()["error"]["message"]
    assert ToolCall.objects.filter(exec_job=job).count() == 1  # nothing recorded of it


def test_a_containers_job_with_a_call_in_flight_is_not_closed(api: Api) -> None:
    """An idle container's job is closed only once no call of it is open: a call long under way is
    not cut; once it has ended, the job is idle from that end."""
    container = f"container_{uuid.uuid4().hex[:12]}"
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(_execute, api, "sleep", container, ms=4000)
        deadline = time.monotonic() + 10
        while not ToolCall.objects.filter(exec_job__container_id=container, claimed_at__isnull=False).exists():
            assert time.monotonic() < deadline, "no tools worker took the call"
            time.sleep(0.05)
        job = _unused_since(container, hours=2)
        assert _job_status_after(job, 3) == "running"  # three reaper rounds, the call open
        called = running.result()
    assert called.status_code == 200 and called.json()["status"] == "completed", called.text
    assert _job_status_after(job, 2) == "running"  # used a moment ago: its call's end
    assert _execute(api, container=container).status_code == 200
    _unused_since(container, hours=2)
    assert _job_status_after(job, 15, until="completed") == "completed"


def test_the_idle_close_reads_no_calls_of_containers_in_use(api: Api, settings: Any) -> None:
    """The reaper's idle close, every round (15 s), read every call of every open container's job
    for its last one's time: a scan growing with the calls containers made. It reads each job's
    ``last_call_at`` (set as a call is recorded and as it returns), and the calls of a job only
    once that says it is idle."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from execution.services.jobs import container_jobs_close_idle

    container = f"container_{uuid.uuid4().hex[:12]}"
    for _ in range(3):
        assert _execute(api, container=container).status_code == 200
    job = ExecJob.objects.get(container_id=container)
    assert job.last_call_at is not None and job.last_call_at >= max(c.finished_at for c in job.tool_calls.all())
    settings.PTC_CONTAINER_IDLE_SECONDS = 30 * 24 * 3600  # no container's job of this session is idle that long
    with CaptureQueriesContext(connection) as queries:
        assert container_jobs_close_idle() == 0
    assert [query["sql"] for query in queries if ToolCall._meta.db_table in query["sql"]] == []
    assert len(queries) == 1, [query["sql"] for query in queries]
    assert ExecJob.objects.get(pk=job.pk).status == "running"
