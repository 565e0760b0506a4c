"""A job's tool calls reach us two ways, from its sandbox over the bridge and over HTTP with its
job-scoped key: its max_tool_calls and its parallel cap hold over both together, calls queued for
a tools worker (no record yet) counted as they are."""

import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from billing.models import Reservation
from execution.backplane import Answer, Ask, backplane, call_channel, job_channel
from execution.models import ToolCall
from tests.conftest import Api
from tests.execution.test_remote_sandbox import _most_at_once
from tests.execution.test_tools_execute import _job_key
from tests.tools.conftest import unique_key
from tests.tools.http_api import HttpApi
from tools.sdk import class_name

ADD = {"toolset": "demo", "tool": "add", "arguments": {"a": 1, "b": 1}}


@pytest.fixture
def stuck(staff: Api) -> Iterator[str]:
    """A priced toolset on tools.slow, which no worker of the test stack serves: a call of it is
    held and queued, and waits there with no record (as any call does until a worker takes it)."""
    key = unique_key("stuck")
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    tool = {"name": "forecast", "input_schema": schema, "http": {"method": "GET", "path": "/f/{city}", "query": []}}
    body = {"key": key, "name": "Stuck", "kind": "http", "config": {"base_url": "http://127.0.0.1:9"}, "tools": [tool]}
    made = staff.post("/api/v1/toolsets", json={**body, "queue": "tools.slow", "price": 1, "is_global": True})
    assert made.status_code == 201, made.text
    yield key
    staff.http.delete(f"/api/v1/toolsets/{key}")


def _stuck_job(api: Api, key: str, queued: int) -> tuple[dict[str, Any], httpx.Client]:
    """A job whose code hands over its key, then makes ``queued`` calls that wait in their queue;
    return it, once they are held and queued, and a client with its key."""
    code = f"""
import threading, time
from ptc_tools import _runtime
from ptc_tools.demo import Demo
from ptc_tools.{key} import {class_name(key)}
Demo.echo(value=_runtime.job_info["key"])
for _ in range({queued}):
    threading.Thread(target={class_name(key)}.forecast, kwargs={{"city": "x"}}, daemon=True).start()
time.sleep(60)
"""
    job = api.run(code, toolsets=["demo", key], wait=0)
    client = httpx.Client(base_url=api.http.base_url, headers={"Authorization": f"Bearer {_job_key(api, job['id'])}"}, timeout=30)
    deadline = time.monotonic() + 20
    while Reservation.objects.filter(exec_job_id=job["id"], status="held").count() < queued:
        assert time.monotonic() < deadline, "the job's calls were not queued"
        time.sleep(0.05)
    return job, client


def _execute(client: httpx.Client, job: dict[str, Any], body: dict[str, Any] = ADD) -> httpx.Response:
    return client.post("/api/v1/tools/execute", json=body, headers={"x-ptc-call-id": job["call_id"]})


def test_calls_over_http_count_the_bridges_calls_still_queued_against_max_tool_calls(api: Api, staff: Api, stuck: str) -> None:
    assert staff.http.patch("/api/v1/policy", json={"max_tool_calls": 3}).status_code == 200
    job, client = _stuck_job(api, stuck, queued=1)  # its echo and its queued call: two of its three
    try:
        first = _execute(client, job)
        assert (first.status_code, first.json()["status"]) == (200, "completed"), first.text
        refused = _execute(client, job)
        assert refused.status_code == 403, refused.text
        assert refused.json()["error"]["code"] == "tool_call_limit"
        assert [c.tool_name for c in ToolCall.objects.filter(exec_job_id=job["id"]).order_by("started_at")] == ["echo", "add"]
    finally:
        assert api.post(f"/api/v1/exec/{job['id']}/cancel").status_code == 200
        client.close()


@pytest.mark.parametrize("policy", [{"max_parallel_tool_calls": 2}, {"sequential": True}])
def test_calls_over_http_count_the_bridges_calls_still_queued_against_the_parallel_cap(
    api: Api, staff: Api, stuck: str, policy: dict[str, Any]
) -> None:
    assert staff.http.patch("/api/v1/policy", json=policy).status_code == 200
    job, client = _stuck_job(api, stuck, queued=policy.get("max_parallel_tool_calls", 1))
    try:
        refused = _execute(client, job)
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["code"] == "parallel_limit"
        assert [c.tool_name for c in ToolCall.objects.filter(exec_job_id=job["id"])] == ["echo"]  # nothing recorded
    finally:
        assert api.post(f"/api/v1/exec/{job['id']}/cancel").status_code == 200
        client.close()


BRIDGE_AFTER = """
import threading, time
from ptc_tools import _runtime
from ptc_tools.demo import Demo
Demo.echo(value=_runtime.job_info["key"])
time.sleep(3)  # the test's call over HTTP is in flight by then, for 5 s
threads = [threading.Thread(target=Demo.sleep, kwargs={"ms": 1000}) for _ in range(2)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
"""


def test_the_bridge_counts_the_calls_over_http_in_flight_against_the_parallel_cap(api: Api, staff: Api) -> None:
    assert staff.http.patch("/api/v1/policy", json={"max_parallel_tool_calls": 2}).status_code == 200
    job = api.run(BRIDGE_AFTER, toolsets=["demo"], wait=0)
    key = _job_key(api, job["id"])
    answers: list[httpx.Response] = []
    with httpx.Client(base_url=api.http.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=30) as client:
        over_http = threading.Thread(
            target=lambda: answers.append(_execute(client, job, {"toolset": "demo", "tool": "sleep", "arguments": {"ms": 5000}}))
        )
        over_http.start()
        deadline = time.monotonic() + 30
        while (final := api.get(f"/api/v1/exec/{job['id']}").json())["status"] == "running":
            assert time.monotonic() < deadline
            time.sleep(0.2)
        over_http.join(30)
    assert answers and answers[0].status_code == 200, answers and answers[0].text
    assert final["status"] == "completed", final["error"]
    sleeps = list(ToolCall.objects.filter(exec_job_id=job["id"], tool_name="sleep"))
    assert len(sleeps) == 3 and all(c.status == "completed" for c in sleeps)
    # The code's two calls ran one after the other: the call over HTTP held the cap's other slot.
    assert _most_at_once(sleeps) == 2


HOLDER = """
import time
from ptc_tools import _runtime
from ptc_tools.demo import Demo
Demo.echo(value=_runtime.job_info["key"])
time.sleep(60)
"""


def _asked(job: dict[str, Any], call_id: str, **ask: Any) -> Answer:
    """Ask the job's bridge to admit ``call_id``, as the web does for a call over HTTP; its answer."""
    with backplane().subscribe(call_channel(call_id)) as answers:
        backplane().publish(job_channel(job["call_id"]), Ask(call_id=call_id, **ask))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            answers.wait(deadline - time.monotonic())
            for message in answers.drain():
                if isinstance(message, Answer) and message.call_id == call_id:
                    return message
    raise AssertionError("the job's bridge did not answer")


def test_a_call_over_http_whose_web_process_died_before_recording_it_holds_its_slot_a_few_heartbeats_at_most(
    api: Api, staff: Api
) -> None:
    """A web process that died between its call's admission and its record never says the call
    ended: the bridge finds no record of it a couple of the job's heartbeats later (1 s here), frees
    its slot and does not count it. The job is not wedged at its parallel cap."""
    assert staff.http.patch("/api/v1/policy", json={"sequential": True, "max_tool_calls": 3}).status_code == 200
    job = api.run(HOLDER, toolsets=["demo"], wait=0)
    client = httpx.Client(base_url=api.http.base_url, headers={"Authorization": f"Bearer {_job_key(api, job['id'])}"}, timeout=30)
    try:
        ghost = f"ptc_{uuid.uuid4().hex}"
        deadline = time.monotonic() + 10
        while not (answer := _asked(job, ghost)).ok:  # its echo is in flight until its result reaches the bridge
            assert answer.code == "parallel_limit" and time.monotonic() < deadline, answer
            time.sleep(0.05)
        held = _execute(client, job)
        assert (held.status_code, held.json()["error"]["code"]) == (429, "parallel_limit"), held.text
        deadline = time.monotonic() + 10
        while (made := _execute(client, job)).status_code == 429:
            assert time.monotonic() < deadline, "the dead call's slot was never freed"
            time.sleep(0.2)
        assert (made.status_code, made.json()["status"]) == (200, "completed"), made.text
        # Its echo and two calls over HTTP: the one that was never recorded is not among its three.
        assert _execute(client, job).status_code == 200
        refused = _execute(client, job)
        assert (refused.status_code, refused.json()["error"]["code"]) == (403, "tool_call_limit"), refused.text
    finally:
        assert api.post(f"/api/v1/exec/{job['id']}/cancel").status_code == 200
        client.close()


def test_calls_over_http_whose_web_process_stalls_before_recording_them_never_take_a_job_past_max_tool_calls(
    api: Api, staff: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A web process that stalls between a call's admission and its record (paused, starved, a table
    locked by a migration) for longer than its bridge waits for the record (two heartbeats, 2 s here)
    is taken for dead: the bridge stops counting those calls and admits others in their place. The
    stalled ones, recorded when their process went on, were run as well: the job made five calls of
    its three. Here the stalled process is this one (its two calls held before their record); the
    job's others are made through the stack's web. The stalled calls are now refused as they are
    recorded, asked again: 403 tool_call_limit, nothing recorded."""
    from django.db import connection

    from execution.services import calls
    from ptcproject.accounts.services import api_key_authenticate
    from ptcproject.errors import ApplicationError

    assert staff.http.patch("/api/v1/policy", json={"max_tool_calls": 3, "max_parallel_tool_calls": 8}).status_code == 200
    job = api.run(HOLDER, toolsets=["demo"], wait=0)
    plaintext = _job_key(api, job["id"])
    key = api_key_authenticate(plaintext=plaintext)
    assert key is not None
    stalled, go = threading.Semaphore(0), threading.Event()
    granted = calls._granted_toolsets

    def held(**kwargs: Any) -> Any:  # after its bridge's answer, before its record
        stalled.release()
        go.wait(30)
        return granted(**kwargs)

    monkeypatch.setattr(calls, "_granted_toolsets", held)
    outcomes: list[str] = []

    def stalled_call() -> None:
        try:
            made = calls.tool_call_standalone(user=key.user, key=key, job_call_id=job["call_id"], **ADD)
            outcomes.append(made.status)
        except ApplicationError as exc:
            outcomes.append(exc.code)
        finally:
            connection.close()

    threads = [threading.Thread(target=stalled_call) for _ in range(2)]
    client = httpx.Client(base_url=api.http.base_url, headers={"Authorization": f"Bearer {plaintext}"}, timeout=30)
    try:
        for thread in threads:
            thread.start()
        for _ in threads:
            assert stalled.acquire(timeout=15), "the stalled calls were not admitted"
        made = []
        until = time.monotonic() + 5  # past the heartbeats the bridge waits for their record
        while time.monotonic() < until:
            made.append(_execute(client, job).status_code)
            time.sleep(0.2)
        go.set()
        for thread in threads:
            thread.join(30)
        # Its echo and the two made through the web once the stalled ones were given up; not those.
        assert ToolCall.objects.filter(exec_job_id=job["id"]).count() == 3
        assert made.count(200) == 2 and set(made) == {200, 403}, made
        assert outcomes == ["tool_call_limit", "tool_call_limit"]
    finally:
        go.set()
        assert api.post(f"/api/v1/exec/{job['id']}/cancel").status_code == 200
        client.close()


def test_a_fence_whose_reply_was_lost_leaves_the_bridge_admitting_under_its_epoch(api: Api, settings, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The bridge fences the calls over HTTP a web process has not recorded (``calls_fence`` raises
    the job's http_admit_epoch): one whose statement committed and whose reply was lost left the
    bridge admitting under the epoch before it, each such call refused as it was recorded, asked
    again, admitted under the same epoch again, in a loop till the next fence. It admits under the
    new one either way: ahead of the database's, an epoch refuses nothing. In this process: a call
    admitted and never recorded, its fence's reply lost."""
    from execution.models import ExecJob
    from execution.services import jobs
    from execution.services.router import JobCallRouter
    from tests.execution.test_exec_api import _queued_job

    settings.PTC_JOB_HEARTBEAT_SECONDS = 0.5
    queued = _queued_job(api, "import time\ntime.sleep(6)")
    job = {"id": str(queued.pk), "call_id": queued.call_id}
    fence, fenced = JobCallRouter.calls_fence, threading.Event()

    def committed_reply_lost(self: JobCallRouter, *, epoch: int) -> bool:
        fence(self, epoch=epoch)
        fenced.set()
        return False

    monkeypatch.setattr(JobCallRouter, "calls_fence", committed_reply_lost)
    runner = threading.Thread(target=jobs.exec_job_run, kwargs={"job_id": job["id"], "worker": "test", "call_id": job["call_id"]})
    runner.start()
    try:
        deadline = time.monotonic() + 20
        while (status := ExecJob.objects.get(pk=queued.pk).status) != "running":  # its channel is listened to
            assert time.monotonic() < deadline, status
            time.sleep(0.05)
        assert _asked(job, f"ptc_{uuid.uuid4().hex}", toolset="demo", tool="echo").ok  # never recorded
        assert fenced.wait(10), "the bridge did not fence the call it admitted"
        admitted = _asked(job, f"ptc_{uuid.uuid4().hex}", toolset="demo", tool="echo")
        assert admitted.ok, admitted
        assert admitted.epoch >= ExecJob.objects.get(pk=queued.pk).http_admit_epoch > 0
    finally:
        runner.join(30)


def test_a_call_over_http_asking_again_as_its_job_ends_is_told_the_job_ended(api: Api, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A call over HTTP admitted while its job ran asks again (its answer was lost) as the job ends:
    its bridge, past its loop, no longer has the job's grant to look the tool up in. It answered
    ``ok`` with no tool, and the web recorded the call failed ``unknown_tool``; it is told the job
    ended, as a new call is. In this process, the repeated ask put on the job's channel as its loop
    ends, for the drain that answers those."""
    from execution.models import ExecJob
    from execution.sandbox.session import Session
    from execution.services import jobs
    from tests.execution.test_exec_api import _queued_job

    queued = _queued_job(api, "import time\ntime.sleep(1)")
    job = {"id": str(queued.pk), "call_id": queued.call_id}
    call_id = f"ptc_{uuid.uuid4().hex}"
    close_calls = Session._close_calls

    def asked_again_then_closed(self: Session):  # type: ignore[no-untyped-def]
        backplane().publish(job_channel(job["call_id"]), Ask(call_id=call_id, toolset="demo", tool="echo"))
        self.channel.wait(10)  # there for the drain
        return close_calls(self)

    monkeypatch.setattr(Session, "_close_calls", asked_again_then_closed)
    runner = threading.Thread(target=jobs.exec_job_run, kwargs={"job_id": job["id"], "worker": "test", "call_id": job["call_id"]})
    with backplane().subscribe(call_channel(call_id)) as answers:
        answers.confirm()
        runner.start()
        deadline = time.monotonic() + 20
        while (status := ExecJob.objects.get(pk=queued.pk).status) != "running":  # its channel is listened to
            assert time.monotonic() < deadline, status
            time.sleep(0.05)
        admitted = _asked(job, call_id, toolset="demo", tool="echo")
        assert admitted.ok and admitted.tool_id, admitted
        runner.join(30)
        queued.refresh_from_db()
        assert queued.status == "completed"
        again = [m for m in answers.drain() if isinstance(m, Answer) and m.call_id == call_id][1:]
    assert [(answer.ok, answer.code) for answer in again] == [(False, "job_ended")]


@pytest.fixture(scope="module")
def http_api() -> Iterator[HttpApi]:
    with HttpApi(expected_key="") as server:
        yield server


def _http_toolset(staff: Api, http_api: HttpApi, name: str, tool: dict[str, Any]) -> str:
    """A global HTTP toolset on ``http_api`` of ``tool``, its key made from ``name``: its key."""
    key = unique_key(name)
    body = {
        "key": key,
        "name": name.title(),
        "kind": "http",
        "is_global": True,
        "config": {"base_url": http_api.url},
        "tools": [tool],
    }
    assert staff.post("/api/v1/toolsets", json=body).status_code == 201
    return key


BOTH_WAYS = """
import time
from ptc_tools import ToolError, _runtime
from ptc_tools.demo import Demo
from ptc_tools.{key} import {cls}
Demo.echo(value=_runtime.job_info["key"])
time.sleep(5)  # the test changes the toolset meanwhile, and calls it over HTTP
try:
    out = ["ok", {cls}.forecast(city="x")]
except ToolError as exc:
    out = [exc.code]
out
"""


@pytest.mark.parametrize(
    ("change", "outcome"), [({"enabled": False}, "tool_disabled"), ({"is_global": False}, "completed"), (None, "unknown_tool")]
)
def test_a_toolset_changed_mid_job_is_called_alike_by_its_code_and_over_http_with_its_key(
    api: Api, staff: Api, http_api: HttpApi, change: dict[str, Any] | None, outcome: str
) -> None:
    """A job calls what it was granted as it started, both ways: a toolset disabled since is refused
    ``tool_disabled`` by the tools worker for both, one made private to another user since still runs
    for both, one deleted (None) fails both ``unknown_tool`` (over HTTP each was 400 unknown_toolset)."""
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    tool = {"name": "forecast", "input_schema": schema, "http": {"method": "GET", "path": "/forecast/{city}", "query": []}}
    key = _http_toolset(staff, http_api, "granted", tool)
    forecast = {"toolset": key, "tool": "forecast", "arguments": {"city": "x"}}
    try:
        job = api.run(BOTH_WAYS.format(key=key, cls=class_name(key)), toolsets=["demo", key], wait=0)
        with httpx.Client(base_url=api.http.base_url, headers={"Authorization": f"Bearer {_job_key(api, job['id'])}"}) as client:
            before = _execute(client, job, forecast)
            assert (before.status_code, before.json()["status"]) == (200, "completed"), before.text
            if change is None:
                assert staff.http.delete(f"/api/v1/toolsets/{key}").status_code == 204
            else:
                assert staff.http.patch(f"/api/v1/toolsets/{key}", json=change).status_code == 200
            time.sleep(2.5)  # past the tools workers' cache of a tool (TOOL_CACHE_SECONDS)
            after = _execute(client, job, forecast)
        deadline = time.monotonic() + 30
        while (final := api.get(f"/api/v1/exec/{job['id']}").json())["status"] == "running":
            assert time.monotonic() < deadline
            time.sleep(0.2)
    finally:
        staff.http.delete(f"/api/v1/toolsets/{key}")
    assert final["status"] == "completed", final["error"]
    assert after.status_code == 200, after.text
    if outcome != "completed":
        assert (after.json()["status"], after.json()["error"]["code"]) == ("failed", outcome)
        assert final["return_value"] == [outcome]
    else:
        assert after.json()["status"] == "completed"
        assert final["return_value"][0] == "ok"


RAISED = """
import time
from ptc_tools import _runtime
from ptc_tools.demo import Demo
Demo.echo(value=_runtime.job_info["key"])
time.sleep(68)  # the test's call over HTTP runs meanwhile, for 75 s from about 3 s in
Demo.echo(value="after")
"""


def _slow_toolset(staff: Api, http_api: HttpApi) -> tuple[str, dict[str, Any]]:
    """A global toolset of one HTTP tool, ``wait``, which answers after ``seconds``, its timeout 1 s
    (a test raises it): its key, and the tool as it was written."""
    schema = {"type": "object", "properties": {"seconds": {"type": "number"}}, "required": ["seconds"]}
    tool = {
        "name": "wait",
        "input_schema": schema,
        "timeout": 1,
        "http": {"method": "GET", "path": "/slow", "query": ["seconds"]},
    }
    return _http_toolset(staff, http_api, "raised", tool), tool


def test_a_call_over_http_holds_its_slot_by_its_tools_timeout_as_it_is_now_not_as_the_job_started(
    api: Api, staff: Api, http_api: HttpApi
) -> None:
    """A tool's timeout raised while a job runs is what its tools worker runs a call of it under,
    and what a call over HTTP with the job's key waits for; its bridge held that call's slot of the
    parallel cap by the timeout as the job started (1 s here), and 60 s more: past that, a
    sequential job's code had its next call run beside it. The slot is held till the call ends."""
    from tools.models import Tool

    assert staff.http.patch("/api/v1/policy", json={"sequential": True}).status_code == 200
    key, _ = _slow_toolset(staff, http_api)
    try:
        job = api.run(RAISED, toolsets=["demo", key], wait=0, timeout=150)
        headers = {"Authorization": f"Bearer {_job_key(api, job['id'])}"}
        assert Tool.objects.filter(toolset__key=key, name="wait").update(timeout=120) == 1  # as in the admin
        time.sleep(2.5)  # past the tools workers' cache of a tool (TOOL_CACHE_SECONDS)
        with httpx.Client(base_url=api.http.base_url, headers=headers, timeout=120) as client:
            slow = _execute(client, job, {"toolset": key, "tool": "wait", "arguments": {"seconds": 75}})
        assert (slow.status_code, slow.json()["status"]) == (200, "completed"), slow.text
        deadline = time.monotonic() + 30
        while (final := api.get(f"/api/v1/exec/{job['id']}").json())["status"] == "running":
            assert time.monotonic() < deadline
            time.sleep(0.2)
    finally:
        staff.http.delete(f"/api/v1/toolsets/{key}")
    assert final["status"] == "completed", final["error"]
    over_http = ToolCall.objects.get(exec_job_id=job["id"], tool_name="wait")
    after = ToolCall.objects.get(exec_job_id=job["id"], tool_name="echo", input={"value": "after"})
    assert over_http.finished_at is not None and after.started_at >= over_http.finished_at


RAISED_FOR_CODE = """
import time
from ptc_tools import ToolError
from ptc_tools.demo import Demo
from ptc_tools.{key} import {cls}
Demo.echo(value="started")
time.sleep(5)  # the test raises the tool's timeout meanwhile
try:
    {cls}.wait(seconds=35)
    out = ["ok"]
except ToolError as exc:
    out = [exc.code]
out
"""


def test_a_call_by_the_jobs_code_is_waited_for_by_its_tools_timeout_as_it_is_now_not_as_the_job_started(
    api: Api, staff: Api, http_api: HttpApi
) -> None:
    """A tool's timeout raised while a job runs is what its tools worker runs the code's next call
    of it under; the bridge gave that call up at its tool's timeout as the job started (1 s here)
    and the grace (30 s): it failed ``tool_timeout`` in the code and in its record, and the tool's
    result, 35 s in, met a call already ended. It is waited for by the timeout as it is."""
    from tools.models import Tool

    key, tool = _slow_toolset(staff, http_api)
    try:
        job = api.run(RAISED_FOR_CODE.format(key=key, cls=class_name(key)), toolsets=["demo", key], wait=0, timeout=120)
        _job_key(api, job["id"])  # its echo: the job runs, with the tool's timeout as it started
        raised = staff.http.patch(f"/api/v1/toolsets/{key}", json={"tools": [{**tool, "timeout": 60}]})
        assert raised.status_code == 200, raised.text
        assert Tool.objects.get(toolset__key=key, name="wait").timeout == 60
        deadline = time.monotonic() + 90
        while (final := api.get(f"/api/v1/exec/{job['id']}").json())["status"] == "running":
            assert time.monotonic() < deadline
            time.sleep(0.2)
    finally:
        staff.http.delete(f"/api/v1/toolsets/{key}")
    assert final["status"] == "completed", final["error"]
    assert final["return_value"] == ["ok"]
    call = ToolCall.objects.get(exec_job_id=job["id"], tool_name="wait")
    assert (call.status, call.error) == ("completed", None)


def test_a_call_over_http_whose_jobs_worker_never_answers_is_503_and_runs_nothing(api: Api) -> None:
    """The job's record says it runs, but no bridge answers (its worker wedged, or one older than the
    web, in a rolling upgrade): past PTC_JOB_LEASE_SECONDS (4 s here) the call is 503
    worker_unavailable, to retry, and nothing is recorded or run."""
    from datetime import timedelta

    from django.contrib.auth import get_user_model
    from django.utils import timezone

    from ptcproject.accounts.services import api_key_create
    from tests.factories import running_job

    user = get_user_model().objects.get(username=api.username)
    now = timezone.now()
    # Its heartbeat ahead: the stack's reaper leaves it running for the test.
    job = running_job(user=user, started_at=now, heartbeat_at=now + timedelta(minutes=5))
    _, key = api_key_create(user=user, exec_job=job)
    client = httpx.Client(base_url=api.http.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=30)
    began = time.monotonic()
    refused = _execute(client, {"call_id": job.call_id})
    assert refused.status_code == 503, refused.text
    assert refused.json()["error"]["code"] == "worker_unavailable"
    assert 3.5 <= time.monotonic() - began < 15
    assert not ToolCall.objects.filter(exec_job=job).exists()
    job.delete()


def test_calls_over_http_waiting_on_a_silent_worker_hold_no_database_connection(api: Api) -> None:
    """Calls over HTTP waiting for the answer of a job's worker that never comes (wedged, or older
    than the web) each held a pooled connection of the web process for PTC_JOB_LEASE_SECONDS:
    PTC_DB_POOL_MAX (20) of them took the pool, and every other request of that process, anyone's,
    was 503 database_unavailable. They wait as a call waits for its result: holding none."""
    from datetime import timedelta

    from django.contrib.auth import get_user_model
    from django.utils import timezone

    from ptcproject.accounts.services import api_key_create
    from tests.factories import running_job

    user = get_user_model().objects.get(username=api.username)
    now = timezone.now()
    job = running_job(user=user, started_at=now, heartbeat_at=now + timedelta(minutes=5))  # the reaper leaves it
    _, key = api_key_create(user=user, exec_job=job)
    waiting = 24  # more than the web's pool (PTC_DB_POOL_MAX, 20)
    answers: list[httpx.Response] = []
    try:
        with httpx.Client(
            base_url=api.http.base_url,
            headers={"Authorization": f"Bearer {key}"},
            timeout=30,
            limits=httpx.Limits(max_connections=waiting),
        ) as client:
            threads = [
                threading.Thread(target=lambda: answers.append(_execute(client, {"call_id": job.call_id})))
                for _ in range(waiting)
            ]
            for thread in threads:
                thread.start()
            time.sleep(1.5)  # all of them asked, and wait
            assert all(thread.is_alive() for thread in threads)
            began = time.monotonic()
            seen = api.get("/api/v1/exec")  # another request of the same web process
            assert seen.status_code == 200, seen.text
            assert time.monotonic() - began < 1.5
            for thread in threads:
                thread.join(30)
        assert len(answers) == waiting
        assert {(answer.status_code, answer.json()["error"]["code"]) for answer in answers} == {(503, "worker_unavailable")}
    finally:
        job.delete()
