"""The path of one job, end to end, through the HTTP API and real workers."""

import time

from tests.conftest import REDIS_PREFIX, Api, calls_most_at_once


def test_stdout_and_return_value(api: Api) -> None:
    job = api.run("print('hello')\nx = 20\nx + 22", toolsets=["demo"])
    assert job["status"] == "completed"
    assert job["success"] is True
    assert job["stdout"] == "hello\n"
    assert job["return_value"] == 42
    assert job["error"] is None
    assert job["call_id"].startswith("exec_")
    assert job["sdk_hash"] and len(job["sdk_hash"]) == 64
    assert job["execution_time_seconds"] > 0
    assert job["started_at"] and job["finished_at"]


def test_location_header_and_get(api: Api) -> None:
    response = api.post("/api/v1/exec", json={"code": "1", "toolsets": ["demo"], "wait": 0})
    assert response.status_code == 201
    job = response.json()
    assert response.headers["Location"] == f"/api/v1/exec/{job['id']}"
    assert job["status"] in ("queued", "running", "completed")
    assert job["success"] in (None, True)
    fetched = api.run("2", toolsets=["demo"])
    assert api.get(f"/api/v1/exec/{fetched['id']}").json()["return_value"] == 2


def test_one_tool_call_and_its_record(api: Api) -> None:
    job = api.run("from ptc_tools.demo import Demo\nDemo.add(a=1, b=2)", toolsets=["demo"])
    assert job["status"] == "completed", job["error"]
    assert job["return_value"] == 3
    [call] = job["tool_calls"]
    assert call["call_id"].startswith("ptc_")
    assert call["type"] == "ptc"
    assert call["ptc_call_id"] == job["call_id"]
    assert (call["toolset"], call["tool"]) == ("demo", "add")
    assert call["input"] == {"a": 1, "b": 2}
    assert call["output"] == 3
    assert call["status"] == "completed"
    assert call["error"] is None
    assert call["duration_ms"] >= 0
    listed = api.get("/api/v1/tool-calls", params={"exec": job["id"]}).json()
    assert listed["count"] == 1
    assert listed["results"][0]["call_id"] == call["call_id"]


def test_parallel_calls_through_threads(api: Api) -> None:
    code = """
from concurrent.futures import ThreadPoolExecutor
from ptc_tools.demo import Demo
with ThreadPoolExecutor(16) as pool:
    results = list(pool.map(lambda _: Demo.sleep(ms=500), range(16)))
results
"""
    job = api.run(code, toolsets=["demo"])
    assert job["status"] == "completed", job["error"]
    assert job["return_value"] == [{"slept_ms": 500}] * 16
    assert len(job["tool_calls"]) == 16
    # Sixteen 0.5 s calls: in series one at a time, in parallel all at once (counted from their
    # records, not timed: the job's time is what the machine's load makes it).
    assert calls_most_at_once(job["tool_calls"]) >= 8, job["tool_calls"]


def test_parallel_calls_through_asyncio_gather(api: Api) -> None:
    code = """
import asyncio
from ptc_tools.demo import Demo
results = await asyncio.gather(*(Demo.sleep.aio(ms=500) for _ in range(16)))
len(results)
"""
    job = api.run(code, toolsets=["demo"])
    assert job["status"] == "completed", job["error"]
    assert job["return_value"] == 16
    assert all(c["status"] == "completed" for c in job["tool_calls"])
    assert calls_most_at_once(job["tool_calls"]) >= 8, job["tool_calls"]


def test_uncaught_tool_error_fails_the_job(api: Api) -> None:
    job = api.run("from ptc_tools.demo import Demo\nDemo.fail(message='boom')", toolsets=["demo"])
    assert job["status"] == "failed"
    assert job["success"] is False
    assert job["error"]["type"] == "ToolError"
    assert job["error"]["message"] == "boom"
    assert job["error"]["tool"] == "demo.fail"
    [call] = job["tool_calls"]
    assert call["status"] == "failed"
    assert call["error"] == {"code": "tool_failed", "message": "boom"}
    assert job["error"]["call_id"] == call["call_id"]


def test_caught_tool_error_lets_the_code_go_on(api: Api) -> None:
    code = """
from ptc_tools import ToolError
from ptc_tools.demo import Demo
try:
    Demo.fail(message="nope")
except ToolError as e:
    print("caught", e.tool, e.message, e.call_id.startswith("ptc_"))
Demo.add(a=2, b=3)
"""
    job = api.run(code, toolsets=["demo"])
    assert job["status"] == "completed", job["error"]
    assert job["stdout"] == "caught demo.fail nope True\n"
    assert job["return_value"] == 5
    assert [c["status"] for c in job["tool_calls"]] == ["failed", "completed"]


def test_schema_invalid_arguments_are_refused_before_running(api: Api) -> None:
    code = """
from ptc_tools import ToolError
from ptc_tools.demo import Demo
try:
    Demo.add(a="one", b=2)
except ToolError as e:
    print(e.code, e.message)
"""
    job = api.run(code, toolsets=["demo"])
    assert job["status"] == "completed", job["error"]
    assert job["stdout"] == "invalid_arguments a: 'one' is not of type 'number'\n"
    [call] = job["tool_calls"]
    assert call["status"] == "failed"
    assert call["error"]["code"] == "invalid_arguments"
    assert call["output"] is None


def test_timeout_then_the_next_job_still_works(api: Api) -> None:
    started = time.monotonic()
    job = api.run("print('spinning')\nwhile True: pass", toolsets=["demo"], timeout=2)
    assert job["status"] == "timeout"
    assert job["error"]["type"] == "Timeout"
    assert job["stdout"] == "spinning\n"
    assert time.monotonic() - started < 10
    assert api.run("'still here'", toolsets=["demo"])["return_value"] == "still here"


def test_cancel_kills_the_job_and_its_queued_calls_never_run(api: Api) -> None:
    code = """
import threading, time
from ptc_tools.demo import Demo
print("started", flush=True)
# 16 calls in flight, 24 more waiting for a slot: none of those may run once cancelled.
threads = [threading.Thread(target=Demo.sleep, kwargs={"ms": 3000}) for _ in range(40)]
[t.start() for t in threads]
[t.join() for t in threads]
"""
    job = api.run(code, toolsets=["demo"], wait=0)
    deadline = time.monotonic() + 15
    while api.get(f"/api/v1/exec/{job['id']}").json()["status"] != "running":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(0.5)
    cancelled = api.post(f"/api/v1/exec/{job['id']}/cancel")
    assert cancelled.status_code == 200, cancelled.text
    assert cancelled.json()["status"] == "cancelled"
    assert cancelled.json()["error"]["type"] == "Cancelled"
    time.sleep(4)  # longer than the calls in flight take
    final = api.get(f"/api/v1/exec/{job['id']}").json()
    assert final["status"] == "cancelled"
    assert final["stdout"] == "started\n"
    calls = final["tool_calls"]
    assert len(calls) <= 16, "calls waiting for a slot were dispatched after the cancel"
    assert all(c["status"] != "executing" for c in calls)
    again = api.post(f"/api/v1/exec/{job['id']}/cancel")
    assert again.status_code == 409
    assert again.json()["error"]["code"] == "job_finished"


def test_other_users_jobs_are_404(make_api) -> None:  # type: ignore[no-untyped-def]
    alice, bob = make_api(), make_api()
    job = alice.run("1", toolsets=["demo"])
    for response in (
        bob.get(f"/api/v1/exec/{job['id']}"),
        bob.post(f"/api/v1/exec/{job['id']}/cancel"),
    ):
        assert response.status_code == 404
        assert response.json()["error"]["code"] == "not_found"
    assert bob.get("/api/v1/tool-calls", params={"exec": job["id"]}).json()["count"] == 0
    assert all(j["id"] != job["id"] for j in bob.get("/api/v1/exec").json()["results"])


def test_list_is_newest_first_and_filters_by_status(api: Api) -> None:
    first = api.run("1", toolsets=["demo"])
    failed = api.run("1/0", toolsets=["demo"])
    listed = api.get("/api/v1/exec").json()
    ids = [j["id"] for j in listed["results"]]
    assert ids.index(failed["id"]) < ids.index(first["id"])
    only_failed = api.get("/api/v1/exec", params={"status": "failed"}).json()["results"]
    assert [j["id"] for j in only_failed] == [failed["id"]]
    assert failed["error"]["type"] == "ZeroDivisionError"
    assert "line 1" in failed["error"]["traceback"]


def _queued_job(api: Api, code: str):  # type: ignore[no-untyped-def]
    from django.contrib.auth import get_user_model

    from execution.models import ExecJob
    from execution.services import jobs

    user = get_user_model().objects.get(username=api.username)
    limits = jobs.job_limits(policy=jobs.policy_get(), timeout=30).as_dict()
    return ExecJob.objects.create(user=user, code=code, toolsets=["demo"], timeout_seconds=30, limits=limits)


SLOW = "print('ran', flush=True)\nimport time\ntime.sleep(5)"


def test_a_cancel_after_the_claim_takes_no_sandbox(api: Api, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # In this process, on the live database and Redis: the job is cancelled while its worker
    # prepares it. The cancel's push is on the job's channel before a sandbox is taken for it (a
    # session's sandbox would be lost with it).
    from execution.models import ExecJob
    from execution.sandbox.session import Session
    from execution.services import jobs
    from ptcproject.policy.models import Policy

    job = _queued_job(api, SLOW)
    prepare = jobs._exec_job_prepare

    def cancelled_then_prepared(*, job: ExecJob, policy: Policy) -> object:
        assert jobs.exec_job_cancel(job=ExecJob.objects.get(pk=job.pk)).status == "cancelled"
        return prepare(job=job, policy=policy)

    runs: list[Session] = []
    monkeypatch.setattr(jobs, "_exec_job_prepare", cancelled_then_prepared)
    monkeypatch.setattr(Session, "run", lambda self: runs.append(self))
    jobs.exec_job_run(job_id=str(job.pk), worker="test", call_id=job.call_id)
    job.refresh_from_db()
    assert (job.status, job.stdout, runs) == ("cancelled", "", [])
    assert job.sdk_hash and len(job.sdk_hash) == 64  # the SDK it was prepared with is kept


def test_a_cancel_as_the_sandbox_is_handed_the_job_sends_no_code(api: Api, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # The cancel lands after that check, as the sandbox is taken: its push is drained before the
    # job's first frame, code included, is written to the sandbox.
    from execution.models import ExecJob
    from execution.sandbox.session import Session
    from execution.services import jobs

    job = _queued_job(api, SLOW)
    run, flush = Session.run, Session._flush
    flushed: list[int] = []

    def cancelled_then_run(self: Session):  # type: ignore[no-untyped-def]
        assert jobs.exec_job_cancel(job=ExecJob.objects.get(pk=job.pk)).status == "cancelled"
        time.sleep(0.5)  # its push reaches the channel
        return run(self)

    monkeypatch.setattr(Session, "run", cancelled_then_run)
    monkeypatch.setattr(Session, "_flush", lambda self, sock: flushed.append(len(self.outbox)) or flush(self, sock))
    started = time.monotonic()
    jobs.exec_job_run(job_id=str(job.pk), worker="test", call_id=job.call_id)
    assert time.monotonic() - started < 4  # not run to its end, nor found cancelled by a heartbeat
    job.refresh_from_db()
    assert (job.status, job.stdout, flushed) == ("cancelled", "", [])


def test_a_job_whose_message_does_not_name_its_call_id_still_runs(stack, api: Api) -> None:  # type: ignore[no-untyped-def]
    # An older web queues a job's id alone; this one names its call_id in a header, so its worker
    # subscribes to the job's channel without reading the job first.
    from django.contrib.auth import get_user_model

    from execution.models import ExecJob
    from execution.services import jobs
    from execution.tasks import run_exec
    from ptcproject import queues
    from ptcproject.celery import task_publish

    user = get_user_model().objects.get(username=api.username)
    limits = jobs.job_limits(policy=jobs.policy_get(), timeout=30).as_dict()
    old = ExecJob.objects.create(user=user, code="6 * 7", toolsets=["demo"], timeout_seconds=30, limits=limits)
    # To the stack's queue (its keys are under its own prefix).
    with run_exec.app.connection_for_write(transport_options={"global_keyprefix": REDIS_PREFIX}) as connection:
        task_publish(run_exec, connection.Producer(), (str(old.pk),), queue=queues.EXEC)
    deadline = time.monotonic() + 30
    while (old := ExecJob.objects.get(pk=old.pk)).status in ("queued", "running"):
        assert time.monotonic() < deadline, old.status
        time.sleep(0.1)
    assert (old.status, old.return_value) == ("completed", 42)
    new = api.run("6 * 7", toolsets=["demo"])
    assert new["return_value"] == 42
    read = [line for line in stack.exec_worker.log.read_text().splitlines() if "does not name its call_id" in line]
    assert any(str(old.pk) in line for line in read)
    assert not any(new["id"] in line for line in read)


def test_a_session_job_cancelled_as_it_starts_leaves_the_session_its_sandbox(api: Api, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # In this process: a session's first job is cancelled as its sandbox is taken, before anything
    # of it reached the sandbox. The session goes on with the same sandbox, and its next job gets
    # what the first never delivered: the SDK and the session's upload.
    from django.contrib.auth import get_user_model
    from django.db import transaction

    from execution.models import ExecJob, ExecSession
    from execution.services import jobs, sessions

    user = get_user_model().objects.get(username=api.username)
    session = sessions.exec_session_create(user=user, toolsets=["demo"], idle_timeout=None, max_lifetime=None)
    sessions.session_file_upload(session=session, path="note.txt", content=b"delivered")

    def session_job(code: str) -> ExecJob:
        with transaction.atomic():
            limits = sessions.session_limits(session=session, job=jobs.job_limits(policy=jobs.policy_get(), timeout=30)).as_dict()
            job = ExecJob.objects.create(
                user=user, code=code, toolsets=list(session.toolsets), timeout_seconds=30, limits=limits, session=session
            )
            sessions.exec_session_take(session_id=session.pk, job=job)
        return job

    first = session_job("print('ran')")
    take = jobs.session_sandbox_take

    def taken_then_cancelled(**kwargs):  # type: ignore[no-untyped-def]
        live = take(**kwargs)
        jobs.exec_job_cancel(job=ExecJob.objects.get(pk=first.pk))
        time.sleep(0.5)  # its push reaches the channel
        return live

    try:
        monkeypatch.setattr(jobs, "session_sandbox_take", taken_then_cancelled)
        jobs.exec_job_run(job_id=str(first.pk), worker="test", node="test-node", call_id=first.call_id)
        monkeypatch.undo()
        first.refresh_from_db()
        assert (first.status, first.stdout) == ("cancelled", "")
        assert ExecSession.objects.get(pk=session.pk).status == "active"

        second = session_job("import ptc_tools.demo\nopen('/work/note.txt').read()")
        jobs.exec_job_run(job_id=str(second.pk), worker="test", node="test-node", call_id=second.call_id)
        second.refresh_from_db()
        assert second.status == "completed", second.error
        assert second.return_value == "delivered"
    finally:
        sessions.exec_sessions_shutdown()  # this process's session sandboxes


def test_a_session_job_keeps_its_end_when_its_sandbox_cant_be_handed_back(api: Api, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # In this process: handing the session's sandbox back fails after the job's code ran. That
    # loses the session (its lease lapses), not the job: what the code did and printed is its end.
    from django.contrib.auth import get_user_model
    from django.db import transaction

    from execution.models import ExecJob
    from execution.services import jobs, sessions

    user = get_user_model().objects.get(username=api.username)
    session = sessions.exec_session_create(user=user, toolsets=["demo"], idle_timeout=None, max_lifetime=None)
    with transaction.atomic():
        limits = sessions.session_limits(session=session, job=jobs.job_limits(policy=jobs.policy_get(), timeout=30)).as_dict()
        job = ExecJob.objects.create(
            user=user,
            code="print('ran')\n2 + 3",
            toolsets=list(session.toolsets),
            timeout_seconds=30,
            limits=limits,
            session=session,
        )
        sessions.exec_session_take(session_id=session.pk, job=job)
    release = jobs.session_sandbox_release

    def released_then_failed(**kwargs):  # type: ignore[no-untyped-def]
        release(**kwargs)
        raise RuntimeError("the session's row could not be written")

    try:
        monkeypatch.setattr(jobs, "session_sandbox_release", released_then_failed)
        jobs.exec_job_run(job_id=str(job.pk), worker="test", node="test-node", call_id=job.call_id)
        job.refresh_from_db()
        assert (job.status, job.error, job.stdout, job.return_value) == ("completed", None, "ran\n", 5)
    finally:
        sessions.exec_sessions_shutdown()


def test_a_tools_worker_logs_each_call_once_with_its_call_id(api: Api, stack) -> None:  # type: ignore[no-untyped-def]
    # Celery's own "received" and "succeeded" lines are left to exec workers (PTC_TOOLS_TASK_EVENTS
    # brings them back on tools workers); a tool call's line is ours, and names the call.
    logs = {process: process.log.stat().st_size for process in (stack.tools_worker, stack.exec_worker)}
    job = api.run("from ptc_tools.demo import Demo\nDemo.add(a=1, b=2)", toolsets=["demo"])
    assert job["return_value"] == 3
    [call] = job["tool_calls"]

    def written(process) -> list[str]:  # type: ignore[no-untyped-def]
        with process.log.open("rb") as handle:
            handle.seek(logs[process])
            return handle.read().decode().splitlines()

    tools = written(stack.tools_worker)
    assert [line for line in tools if call["call_id"] in line and "tool call ran" in line and f"job_id={job['id']}" in line]
    assert not [line for line in tools if "execution.tasks.execute_tool[" in line]
    assert [line for line in written(stack.exec_worker) if "execution.tasks.run_exec[" in line and "received" in line]


def test_a_workers_acks_reach_redis(api: Api) -> None:
    # Acks made in a worker's event loop are sent together at the end of its turn
    # (ptcproject/broker.py): none is left behind, or its message would run again after the
    # visibility timeout.
    import redis

    from tests.conftest import REDIS_URL

    code = "from concurrent.futures import ThreadPoolExecutor\nfrom ptc_tools.demo import Demo\n"
    code += "with ThreadPoolExecutor(8) as pool:\n    list(pool.map(lambda n: Demo.add(a=n, b=1), range(40)))"
    job = api.run(code, toolsets=["demo"])
    assert job["status"] == "completed" and len(job["tool_calls"]) == 40
    ours = [call["call_id"].encode() for call in job["tool_calls"]] + [job["call_id"].encode()]
    deadline = time.monotonic() + 10
    with redis.Redis.from_url(REDIS_URL) as server:  # its messages' headers name the calls (argsrepr) and the job
        while left := [entry for entry in server.hvals(f"{REDIS_PREFIX}unacked") if any(name in entry for name in ours)]:
            assert time.monotonic() < deadline, f"{len(left)} messages of the job were never acked"
            time.sleep(0.05)
