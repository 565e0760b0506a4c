"""Limits, quotas and fleet operations pushed from the wrong side, on the real stack: each test here
is a way someone got past a limit, or an operation that misled its operator, before it was fixed."""

import base64
import io
import itertools
import json
import logging
import os
import signal
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection

from execution.backplane import RedisBackplane, backplane
from execution.models import ExecJob, ToolCall, WorkFile
from execution.services.calls import CALL_RECORD_BYTES
from execution.services.retention import exec_jobs_purge
from ptcproject.accounts.models import UserSettings
from ptcproject.errors import MAX_ERROR_MESSAGE
from tests.conftest import Api
from tests.execution.client_loop import sse_events
from tests.execution.test_tools_execute import _job_key
from tests.stack import Stack


def _patch(staff: Api, **values: Any) -> None:
    response: httpx.Response = staff.http.patch("/api/v1/policy", json=values)
    assert response.status_code == 200, response.text


THREADED_SLEEPS = """
from concurrent.futures import ThreadPoolExecutor
from ptc_tools.demo import Demo
with ThreadPoolExecutor(4) as pool:
    list(pool.map(lambda _: Demo.sleep(ms=300), range({count})))
"""


def test_a_session_opened_before_a_policy_change_runs_its_next_job_under_the_new_policy(staff: Api, api: Api) -> None:
    """The policy's per-job limits take effect on the next request: a job in a session opened
    before the change is such a request. Its sandbox's memory and processes are fixed at its first
    job (README, Sessions); how many calls the job may make, and how many at once, are not."""
    created = api.post("/api/v1/sessions", json={"toolsets": ["demo"]})
    assert created.status_code == 201, created.text
    session = created.json()["id"]
    warm = api.run("1", session=session)  # the sandbox is started under the old policy
    assert warm["status"] == "completed", warm["error"]
    _patch(staff, sequential=True, max_tool_calls=3)

    job = api.run(THREADED_SLEEPS.format(count=3), session=session)
    assert job["status"] == "completed", job["error"]
    assert job["sequential"] is True
    calls = sorted(job["tool_calls"], key=lambda c: c["started_at"])
    assert len(calls) == 3
    for before, after in itertools.pairwise(calls):  # one at a time, as the job's record says
        assert before["finished_at"] <= after["started_at"], calls

    over = api.run(THREADED_SLEEPS.format(count=4), session=session)
    assert over["status"] == "failed" and over["error"]["type"] == "ResourceLimit", over
    assert "tool-call limit of 3" in over["error"]["message"]


def test_check_ledger_finds_nothing_wrong_while_calls_are_billed(api: Api) -> None:
    """An operator runs check_ledger on a live fleet: calls holding and settling credits as it reads
    must not show as accounts that differ from their ledger."""
    code = """
from concurrent.futures import ThreadPoolExecutor
from ptc_tools.demo import Demo
with ThreadPoolExecutor(16) as pool:
    list(pool.map(lambda i: Demo.add(a=i, b=1), range(600)))
"""
    job = api.post("/api/v1/exec", json={"code": code, "toolsets": ["demo"], "wait": 0}).json()
    deadline = time.monotonic() + 60
    checks = 0
    while ExecJob.objects.filter(pk=job["id"], status__in=("queued", "running")).exists():
        assert time.monotonic() < deadline
        try:
            call_command("check_ledger", stdout=io.StringIO(), stderr=io.StringIO())
        except CommandError as exc:
            raise AssertionError(f"check_ledger failed on a sound ledger after {checks} good checks: {exc}") from exc
        checks += 1
    assert ExecJob.objects.get(pk=job["id"]).status == "completed"
    assert checks > 0


BAD_PTC_EXEC = {
    "a timeout below the API's least": ("print(1)", ["--timeout", "-5"], "timeout"),
    "a timeout of zero": ("print(1)", ["--timeout", "0"], "timeout"),
    "a timeout that is no number": ("print(1)", ["--timeout", "nan"], "timeout"),
    "a title over 500 characters": ("print(1)", ["--title", "t" * 501], "title"),
    "code with a NUL": ("print(1)\x00", [], "code"),
    "a file that is not UTF-8": (b"\xff\xfeprint(1)", [], "UTF-8"),
    "client tools that can't be imported": ("print(1)", ["--client-tools", "no_such_module_here_xyz"], "could not be imported"),
}


@pytest.mark.parametrize("case", BAD_PTC_EXEC, ids=list(BAD_PTC_EXEC))
def test_ptc_exec_refuses_bad_arguments_saying_why_and_queues_nothing(api: Api, tmp_path: Path, case: str) -> None:
    content, flags, named = BAD_PTC_EXEC[case]
    path = tmp_path / "job.py"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    with pytest.raises(CommandError, match=named):
        call_command("ptc_exec", str(path), "--user", api.username, *flags, stdout=io.StringIO(), stderr=io.StringIO())
    assert not ExecJob.objects.filter(user__username=api.username).exists()


@pytest.mark.parametrize("timeout", [-5.0, 0.0, float("nan")])
def test_a_job_with_a_timeout_no_worker_would_take_is_refused_by_the_service_itself(timeout: float) -> None:
    """Every caller checks a job's timeout with POST /exec's serializer; one that did not (ptc_exec
    did not) queued a job no worker took, and waited for it for ever. The service refuses it too."""
    from execution.services.jobs import exec_job_create
    from ptcproject.errors import ApplicationError

    user = get_user_model().objects.create_user(username=f"t-{uuid.uuid4().hex[:6]}")
    with pytest.raises(ApplicationError) as refused:
        exec_job_create(user=user, code="print(1)", toolsets=["demo"], timeout=timeout)
    assert (refused.value.code, list(refused.value.details)) == ("validation_error", ["timeout"])
    assert not ExecJob.objects.filter(user=user).exists()


def test_ptc_exec_refuses_a_deactivated_user(tmp_path: Path) -> None:
    user = get_user_model().objects.create_user(username=f"gone-{uuid.uuid4().hex[:6]}", is_active=False)
    path = tmp_path / "job.py"
    path.write_text("print(1)")
    with pytest.raises(CommandError, match="no active user"):
        call_command("ptc_exec", str(path), "--user", user.username, stdout=io.StringIO(), stderr=io.StringIO())
    assert not ExecJob.objects.filter(user=user).exists()


@pytest.mark.parametrize(
    ("username", "flags", "named"),
    [
        ("", [], "blank"),
        ("x" * 151, [], "at most 150"),
        ("two words!", [], "valid username"),
        (f"long-{uuid.uuid4().hex[:6]}", ["--name", "n" * 101], "at most 100"),
        (f"rich-{uuid.uuid4().hex[:6]}", ["--credits", str(10**20)], "range"),
    ],
)
def test_create_api_key_refuses_bad_arguments_saying_why_and_creates_nothing(username: str, flags: list[str], named: str) -> None:
    with pytest.raises(CommandError, match=named):
        call_command("create_api_key", username, "--create-user", *flags, stdout=io.StringIO(), stderr=io.StringIO())
    assert not get_user_model().objects.filter(username=username).exists()


def test_create_api_key_logs_a_key_only_once_it_is_made() -> None:
    """The audit's log line for a key went out inside the command's transaction: a run that then
    failed (credits out of range) rolled the key back and still logged it created."""
    said: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = said.append  # type: ignore[method-assign]
    audit = logging.getLogger("ptc.accounts")
    audit.addHandler(handler)
    try:
        failed, made = (f"{name}-{uuid.uuid4().hex[:6]}" for name in ("failed", "made"))
        with pytest.raises(CommandError, match="range"):
            call_command("create_api_key", failed, "--create-user", "--credits", str(10**20), stdout=io.StringIO())
        call_command("create_api_key", made, "--create-user", stdout=io.StringIO())
    finally:
        audit.removeHandler(handler)
    owners = [getattr(record, "owner_id", None) for record in said if record.getMessage() == "api key created"]
    assert owners == [get_user_model().objects.get(username=made).pk]


def test_create_api_key_run_twice_at_once_for_a_new_user_gives_each_a_key() -> None:
    username = f"twice-{uuid.uuid4().hex[:6]}"
    start = threading.Barrier(4)

    def create(_: int) -> str:
        start.wait()
        try:
            out = io.StringIO()
            call_command("create_api_key", username, "--create-user", "--credits", "5", stdout=out, stderr=io.StringIO())
            return out.getvalue().splitlines()[-1]
        finally:
            connection.close()

    with ThreadPoolExecutor(4) as pool:
        keys = list(pool.map(create, range(4)))
    user = get_user_model().objects.get(username=username)
    assert len(set(keys)) == 4 and all(k.startswith("ptc_") for k in keys)
    assert user.api_keys.count() == 4
    assert user.credit_account.balance == 20


def test_a_managed_containers_calls_are_purged_past_retention_like_any_others(api: Api) -> None:
    """A managed container's job never finishes (its container may call back), so retention, which
    purges finished jobs, never reached its calls: their inputs and outputs were kept for ever."""
    user = get_user_model().objects.get(username=api.username)
    UserSettings.objects.create(user=user, retention_days=0)
    container = f"container_{uuid.uuid4().hex[:12]}"
    caller = {"type": "code_execution_20260120", "tool_id": "srvtoolu_1"}
    body = {"toolset": "demo", "tool": "echo", "arguments": {"value": "private input"}, "caller": caller}
    called = api.post("/api/v1/tools/execute", json={**body, "container_id": container})
    assert called.status_code == 200 and called.json()["status"] == "completed", called.text
    alone = api.post("/api/v1/tools/execute", json={k: body[k] for k in ("toolset", "tool", "arguments")})
    assert alone.status_code == 200 and alone.json()["type"] == "standalone", alone.text
    deadline = time.monotonic() + 20
    while ToolCall.objects.get(call_id=alone.json()["call_id"]).output is not None:  # beat's round, every second here
        assert time.monotonic() < deadline, "beat did not purge the zero-retention standalone call"
        time.sleep(0.2)
    time.sleep(2)  # a round more: it purges both kinds in one
    call = ToolCall.objects.get(call_id=called.json()["call_id"])
    assert (call.input, call.output, call.status, call.credits) == ({}, None, "completed", 0), call
    # What it passed no longer counts against the bytes its job's calls may pass: its record does.
    assert ExecJob.objects.get(pk=call.exec_job_id).http_tool_bytes == CALL_RECORD_BYTES
    if isinstance(backplane(), RedisBackplane):  # its job's live event log repeated them, and never expires
        assert backplane().events_read(called.json()["ptc_call_id"]) == []
    # The container's job goes on: its next call is recorded, and kept until its own round.
    again = api.post("/api/v1/tools/execute", json={**body, "container_id": container})
    assert again.status_code == 200 and again.json()["status"] == "completed", again.text
    assert again.json()["ptc_call_id"] == called.json()["ptc_call_id"]


def test_retention_purges_the_files_a_job_was_given_and_wrote(api: Api) -> None:
    """Files are what the code read and wrote: a purged job's output, downloadable until purged."""
    UserSettings.objects.create(user=get_user_model().objects.get(username=api.username), retention_days=0)
    files = {"input.txt": base64.b64encode(b"private input").decode()}
    job = api.run("open('upper.txt', 'w').write(open('input.txt').read().upper())", files=files)
    assert job["status"] == "completed", job["error"]
    assert api.get(f"/api/v1/exec/{job['id']}/files/upper.txt").content == b"PRIVATE INPUT"
    deadline = time.monotonic() + 20
    while ExecJob.objects.get(pk=job["id"]).purged_at is None:  # beat's round, every second here
        assert time.monotonic() < deadline, "beat did not purge the zero-retention job"
        time.sleep(0.2)
    assert api.get(f"/api/v1/exec/{job['id']}/files/upper.txt").status_code == 404
    assert not WorkFile.objects.filter(exec_job_id=job["id"]).exists()


def test_a_job_cancelled_as_it_ran_is_purged_once_its_worker_has_closed_it(api: Api, stack: Stack) -> None:
    """A cancel ends a running job at once; its worker then kills the sandbox and writes what the
    code printed. Purged in between, the job got its output back after the purge, and kept it."""
    UserSettings.objects.create(user=get_user_model().objects.get(username=api.username), retention_days=0)
    job = api.run("import time\nprint('private output', flush=True)\ntime.sleep(60)", wait=0, timeout=120)
    assert api.until_printed(job["id"]) == "private output\n"
    assert stack.exec_worker.proc is not None
    worker = stack.exec_worker.proc.pid
    os.kill(worker, signal.SIGSTOP)  # the moment between the cancel and the worker's close, held open
    try:
        assert api.post(f"/api/v1/exec/{job['id']}/cancel").status_code == 200
        exec_jobs_purge()
    finally:
        os.kill(worker, signal.SIGCONT)
    deadline = time.monotonic() + 30
    while (row := ExecJob.objects.get(pk=job["id"])).closed_at is None or row.purged_at is None:
        assert time.monotonic() < deadline, f"closed at {row.closed_at}, purged at {row.purged_at}"
        time.sleep(0.2)
    exec_jobs_purge()  # a round after the close: whatever it does, the output is gone
    row = ExecJob.objects.get(pk=job["id"])
    assert (row.status, row.stdout, row.purged_at is not None) == ("cancelled", "", True)


def test_a_job_whose_calls_pass_too_many_bytes_ends_before_its_views_grow_without_bound(api: Api) -> None:
    """Each call is recorded whole, and every view of a job (its exec_end event, GET, MCP's result)
    carries every call's arguments and result: a job echoing a megabyte a call made views of
    gigabytes. Past PTC_MAX_JOB_TOOL_BYTES (8 MiB on the test stack) the job ends, ResourceLimit."""
    code = "from ptc_tools.demo import Demo\nbig = 'x' * 900_000\nfor _ in range(12):\n    Demo.echo(value=big)\n'all'"
    job = api.run(code, toolsets=["demo"])
    assert job["status"] == "failed", (job["status"], job["return_value"])
    assert job["error"]["type"] == "ResourceLimit" and "PTC_MAX_JOB_TOOL_BYTES" in job["error"]["message"], job["error"]
    # Stopped at the call that passed the bound: each passes 1.8 MB (in and out), so the fifth.
    assert 4 <= len(job["tool_calls"]) <= 6, len(job["tool_calls"])
    assert len(api.get(f"/api/v1/exec/{job['id']}").content) < 12 << 20


def test_a_managed_containers_calls_are_held_to_the_bytes_one_jobs_may_pass(api: Api) -> None:
    """A managed container's job runs until cancelled, and every view of it (GET, the cancel's
    answer, its exec_end) carries every call: its calls were counted against nothing, so one
    container made views of any size, built whole in the web. Past PTC_MAX_JOB_TOOL_BYTES (8 MiB
    here) its next call is refused, 403 tool_bytes_limit, and nothing recorded."""
    container = f"container_{uuid.uuid4().hex[:12]}"
    caller = {"type": "code_execution_20260120", "tool_id": "srvtoolu_1"}
    body = {"toolset": "demo", "tool": "echo", "container_id": container, "caller": caller}
    for value in range(10):  # small calls count too, each by its whole record
        called = api.post("/api/v1/tools/execute", json={**body, "arguments": {"value": value}})
        assert called.status_code == 200 and called.json()["status"] == "completed", called.text
    [job] = ExecJob.objects.filter(container_id=container)
    view = api.get(f"/api/v1/exec/{job.pk}").json()
    assert len(json.dumps(view["tool_calls"])) <= job.http_tool_bytes < 10 * 1024, job.http_tool_bytes
    answers = [api.post("/api/v1/tools/execute", json={**body, "arguments": {"value": "x" * 900_000}}) for _ in range(6)]
    # Each passes 1.8 MB (in and out): the fifth ends past 8 MiB, and the sixth is refused.
    assert [a.status_code for a in answers] == [200] * 5 + [403], [a.text[:200] for a in answers]
    refused = answers[-1].json()["error"]
    assert refused["code"] == "tool_bytes_limit" and refused["details"] == {"limit": 8 << 20}, refused
    assert "PTC_MAX_JOB_TOOL_BYTES" in refused["message"] and "new container" in refused["message"], refused
    assert ToolCall.objects.filter(exec_job=job).count() == 15
    assert len(api.get(f"/api/v1/exec/{job.pk}").content) < 12 << 20
    cancelled = api.post(f"/api/v1/exec/{job.pk}/cancel")
    assert cancelled.status_code == 200 and len(cancelled.content) < 12 << 20


BIG_THEN_WAITS = """
import time
from ptc_tools import _runtime
from ptc_tools.demo import Demo
Demo.echo(value=_runtime.job_info["key"])  # hands the test this job's key through the call record
big = "x" * 900_000
for _ in range(4):
    Demo.echo(value=big)
print("passed", flush=True)
time.sleep(60)
"""


def test_a_jobs_calls_over_http_with_its_key_count_with_its_bridges_against_its_bytes(api: Api) -> None:
    """The bridge held a job's calls to PTC_MAX_JOB_TOOL_BYTES, but the same code could pass any
    amount more through POST /tools/execute with its job's key, each call recorded whole in its
    views. They are counted now, with the bridge's: here 7.2 MB over the bridge, then two calls of
    0.9 MB each way over HTTP, and the job ends ResourceLimit (8 MiB here) as it would over the
    bridge."""
    job = api.run(BIG_THEN_WAITS, toolsets=["demo"], wait=0)
    key = _job_key(api, job["id"])
    assert api.until_printed(job["id"]) == "passed\n"
    remote = httpx.Client(base_url=api.http.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=30)
    body = {"toolset": "demo", "tool": "echo", "arguments": {"value": "x" * 900_000}}
    with remote:
        for _ in range(2):
            remote.post("/api/v1/tools/execute", json=body, headers={"x-ptc-call-id": job["call_id"]})
    deadline = time.monotonic() + 15
    while (final := api.get(f"/api/v1/exec/{job['id']}").json())["status"] == "running":
        assert time.monotonic() < deadline, "the job went on past its bytes"
        time.sleep(0.2)
    assert (final["status"], final["error"]["type"]) == ("failed", "ResourceLimit"), final["error"]
    assert "PTC_MAX_JOB_TOOL_BYTES" in final["error"]["message"], final["error"]


def test_a_managed_containers_calls_at_once_pass_its_bytes_by_one_call_at_most(api: Api) -> None:
    """A container's call was held to PTC_MAX_JOB_TOOL_BYTES by its arguments, its result counted
    once it came: calls made at once all passed on what was counted before any result came (a
    container has no parallel cap), and their results together took the job as far past the bound
    as it made calls at once. Here 12 of 0.9 MB each way, 8 MiB: nine were run, 16 MB in all."""
    from concurrent.futures import ThreadPoolExecutor

    container = f"container_{uuid.uuid4().hex[:12]}"
    caller = {"type": "code_execution_20260120", "tool_id": "srvtoolu_1"}
    body = {"toolset": "demo", "tool": "echo", "container_id": container, "caller": caller}
    assert api.post("/api/v1/tools/execute", json={**body, "arguments": {"value": 0}}).status_code == 200
    big = {**body, "arguments": {"value": "x" * 900_000}}
    with ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(lambda _: api.post("/api/v1/tools/execute", json=big), range(12)))
    assert {a.status_code for a in answers} == {200, 403}, [a.text[:200] for a in answers]
    [job] = ExecJob.objects.filter(container_id=container)
    passed = sum(len(json.dumps(c.input)) + len(json.dumps(c.output)) for c in ToolCall.objects.filter(exec_job=job))
    assert passed <= (8 << 20) + (1 << 20), (passed, [a.status_code for a in answers])


def test_a_tool_errors_message_is_recorded_and_told_cut_to_its_bound(api: Api) -> None:
    """A tool's failure message was kept whole wherever it went: a call failed with a megabyte of
    message (``Demo.fail``'s own argument, a remote server's error text) recorded it in its row,
    its event and the error raised in the code. It is cut to MAX_ERROR_MESSAGE characters, saying so."""
    code = "from ptc_tools import ToolError\nfrom ptc_tools.demo import Demo\ntry:\n    Demo.fail(message='x' * 1_000_000)\nexcept ToolError as e:\n    print(len(str(e)))"
    job = api.run(code, toolsets=["demo"])
    assert job["status"] == "completed", job["error"]
    [call] = job["tool_calls"]
    message = call["error"]["message"]
    assert message.startswith("x" * 1000) and message.endswith("… (1000000 characters, cut)")
    assert len(message) <= MAX_ERROR_MESSAGE
    assert int(job["stdout"]) <= MAX_ERROR_MESSAGE + 100
    [end] = [data for event, data in sse_events(api, job["id"]) if event == "tool_call_error"]
    assert end["error"]["message"] == message
