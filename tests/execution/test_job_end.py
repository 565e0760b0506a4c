"""A job's end, as announced (exec_end, the End its waiters get, a cancel's answer), is its last word:
the calls a tools worker was running when the job ended are in it as they ended, and charged."""

import json
import threading
import time
import uuid
from datetime import timedelta
from typing import Any

import pytest

from tests.conftest import Api
from tests.execution.client_loop import sse_events

SLEEP_MS = 3000
# Calls Demo.sleep (1 credit) and prints once the call is on its way: the job is ended while it runs.
CALLS_A_SLOW_TOOL = f"""
import threading
from ptc_tools.demo import Demo
t = threading.Thread(target=Demo.sleep, kwargs={{"ms": {SLEEP_MS}}})
t.start()
print("calling", flush=True)
t.join()
"""


def _running_call(api: Api, job_id: str) -> dict[str, Any]:
    """Wait until the job's one call is claimed by a tools worker (its record is written by the
    claim), and return the job."""
    deadline = time.monotonic() + 15
    while True:
        job = api.get(f"/api/v1/exec/{job_id}").json()
        if job["tool_calls"] and job["tool_calls"][0]["status"] == "executing":
            return job
        assert time.monotonic() < deadline, job
        time.sleep(0.05)


def _waiting(api: Api, code: str, **body: Any) -> tuple[threading.Thread, dict[str, Any]]:
    """Submit ``code`` on a thread with a wait of 30 s: its answer is the End pushed to the waiter."""
    answer: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: answer.update(api.run(code, toolsets=["demo"], wait=30, **body)))
    thread.start()
    return thread, answer


def _newest_job(api: Api) -> str:
    deadline = time.monotonic() + 15
    while not (jobs := api.get("/api/v1/exec").json()["results"]):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return str(jobs[0]["id"])


def _settled(api: Api, job_id: str) -> dict[str, Any]:
    """The job once its calls have all ended (they run at most SLEEP_MS): its record, as GET shows it."""
    deadline = time.monotonic() + SLEEP_MS / 1000 + 15
    while True:
        job = api.get(f"/api/v1/exec/{job_id}").json()
        if all(c["status"] != "executing" for c in job["tool_calls"]):
            return job
        assert time.monotonic() < deadline, job
        time.sleep(0.1)


def _charged(api: Api, job_id: str) -> int:
    """What the account was charged for the job's calls, by its usage rows (the ledger's charges)."""
    return sum(row["amount"] for row in api.get("/api/v1/billing/usage", params={"exec": job_id}).json()["results"])


def _logged_ends(job_call_id: str) -> list[dict[str, Any]]:
    """The ``exec_end`` events in the job's log, once there is one (within 10 s)."""
    from execution.backplane import backplane

    deadline = time.monotonic() + 10
    while not (ends := [data for _, name, data in backplane().events_read(job_call_id) if name == "exec_end"]):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return ends


def _as_announced(view: dict[str, Any]) -> tuple[str, list[tuple[str, str, int]], int]:
    return (
        view["status"],
        [(c["call_id"], c["status"], c["credits"]) for c in view["tool_calls"]],
        view["credits_charged"],
    )


def test_a_job_cancelled_while_a_call_runs_announces_that_call_as_it_ended_and_charged(api: Api) -> None:
    """A cancel's answer, exec_end and the End its waiter got showed the call a tools worker was
    running still executing and credits_charged 0, though the call then completed and was charged:
    only a later GET said so."""
    waiter, ended = _waiting(api, CALLS_A_SLOW_TOOL)
    job_id = _newest_job(api)
    _running_call(api, job_id)
    cancelled = api.post(f"/api/v1/exec/{job_id}/cancel")
    assert cancelled.status_code == 200, cancelled.text
    waiter.join(40)
    final = _settled(api, job_id)
    [call] = final["tool_calls"]
    assert (final["status"], call["status"], final["credits_charged"]) == ("cancelled", "completed", 1)
    assert _charged(api, job_id) == 1
    assert api.get("/api/v1/billing/balance").json()["balance"] == 10_000 - 1
    events = list(sse_events(api, job_id, timeout=15))
    # The stream closes after exec_end: the call's own end comes before it, not after.
    assert [name for name, _ in events if name.startswith(("tool_call", "exec_end"))][-2:] == ["tool_call_end", "exec_end"]
    assert _as_announced(events[-1][1]) == _as_announced(final), "exec_end"
    assert _as_announced(ended) == _as_announced(final), "the End its waiter got"
    assert _as_announced(cancelled.json()) == _as_announced(final), "the cancel's answer"


def test_a_job_that_times_out_while_a_call_runs_announces_that_call_as_it_ended_and_charged(api: Api) -> None:
    """A job whose timeout came while a tools worker ran its call announced its end (exec_end, its
    waiter's End) with the call executing and nothing charged; the call then completed and was charged."""
    waiter, ended = _waiting(api, CALLS_A_SLOW_TOOL, timeout=1)
    job_id = _newest_job(api)
    waiter.join(40)
    final = _settled(api, job_id)
    [call] = final["tool_calls"]
    assert (final["status"], call["status"], final["credits_charged"]) == ("timeout", "completed", 1)
    assert _charged(api, job_id) == 1
    [end] = [data for name, data in sse_events(api, job_id, timeout=15) if name == "exec_end"]
    assert _as_announced(end) == _as_announced(final), "exec_end"
    assert _as_announced(ended) == _as_announced(final), "the End its waiter got"


def test_a_reader_following_a_job_whose_end_waits_for_a_long_call_gets_that_end(api: Api) -> None:
    """A reader takes a job's end from the records when its log has none 10 s after the job's
    close (an append lost to Redis), and only waited for the close's queued and waiting calls:
    while the worker still waited for a longer call a tools worker ran, the reader took an end
    with that call executing and nothing charged, and every reader of the log got it."""
    code = CALLS_A_SLOW_TOOL.replace(f'"ms": {SLEEP_MS}', '"ms": 14000')
    job = api.run(code, toolsets=["demo"], wait=0, timeout=1)
    [end] = [data for name, data in sse_events(api, job["id"], timeout=60) if name == "exec_end"]
    assert (end["status"], [(c["status"], c["credits"]) for c in end["tool_calls"]]) == ("timeout", [("completed", 1)])


def test_a_job_ended_by_a_limit_while_a_call_runs_announces_that_call_as_it_ended_and_charged(api: Api) -> None:
    """A job that passed PTC_MAX_JOB_TOOL_BYTES (8 MiB on the test stack) while a tools worker ran
    another of its calls announced its end with that call executing and nothing charged for it."""
    code = f"""
import threading
from ptc_tools.demo import Demo
t = threading.Thread(target=Demo.sleep, kwargs={{"ms": {SLEEP_MS}}})
t.start()
big = "x" * 900_000
for _ in range(12):
    Demo.echo(value=big)
"""
    waiter, ended = _waiting(api, code)
    job_id = _newest_job(api)
    waiter.join(40)
    final = _settled(api, job_id)
    assert (final["status"], final["error"]["type"]) == ("failed", "ResourceLimit"), final["error"]
    [slept] = [c for c in final["tool_calls"] if c["tool"] == "sleep"]
    assert (slept["status"], slept["credits"], final["credits_charged"], _charged(api, job_id)) == ("completed", 1, 1, 1)
    [end] = [data for name, data in sse_events(api, job_id, timeout=15) if name == "exec_end"]
    assert _as_announced(end) == _as_announced(final), "exec_end"
    assert _as_announced(ended) == _as_announced(final), "the End its waiter got"


def test_a_managed_containers_job_cancelled_while_a_call_runs_announces_that_call_as_it_ended(api: Api) -> None:
    """Cancelling a managed container's job while its call ran answered, and announced, the call
    executing and nothing charged; the call then completed and was charged."""
    container = f"container_{uuid.uuid4().hex[:12]}"
    body = {"toolset": "demo", "tool": "sleep", "container_id": container}
    body["caller"] = {"type": "code_execution_20250825", "tool_id": "srvtoolu_1"}
    first = api.post("/api/v1/tools/execute", json={**body, "arguments": {"ms": 0}})
    assert first.status_code == 200, first.text
    answer: dict[str, Any] = {}
    call = threading.Thread(
        target=lambda: answer.update(api.post("/api/v1/tools/execute", json={**body, "arguments": {"ms": SLEEP_MS}}).json())
    )
    call.start()
    job_id = _newest_job(api)
    deadline = time.monotonic() + 15
    while len(api.get(f"/api/v1/exec/{job_id}").json()["tool_calls"]) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(0.5)  # claimed by a tools worker, and running
    cancelled = api.post(f"/api/v1/exec/{job_id}/cancel")
    assert cancelled.status_code == 200, cancelled.text
    call.join(40)
    final = _settled(api, job_id)
    assert [c["status"] for c in final["tool_calls"]] == ["completed", "completed"]
    assert (final["status"], final["credits_charged"], _charged(api, job_id)) == ("cancelled", 2, 2)
    assert answer["status"] == "completed"
    [end] = [data for name, data in sse_events(api, job_id, timeout=15) if name == "exec_end"]
    assert _as_announced(end) == _as_announced(final), "exec_end"
    assert _as_announced(cancelled.json()) == _as_announced(final), "the cancel's answer"


class _WorkerKilled(BaseException):
    """What stands for the worker's process dying where it is raised: nothing after it runs."""


def test_a_managed_containers_idle_close_whose_reaper_died_before_announcing_it_still_ends_its_stream(
    api: Api, monkeypatch: pytest.MonkeyPatch, settings: Any
) -> None:
    """The reaper's idle close commits the job's end, ``closed_at`` with it, then announces it: a
    reaper dead between the two left exec_end unsent. Its readers take it from the records once
    the close is END_LOST_SECONDS old (events._end_lost), as for any job whose closer died there,
    and append it to the log for the next. Run here, the close dies there; the stack's own reaper
    (idle after an hour) leaves the job be."""
    from execution.backplane import backplane
    from execution.events import END_LOST_SECONDS
    from execution.models import ExecJob
    from execution.services import jobs

    container = f"container_{uuid.uuid4().hex[:12]}"
    body = {"toolset": "demo", "tool": "echo", "arguments": {"value": 1}, "container_id": container}
    body["caller"] = {"type": "code_execution_20260120", "tool_id": "srvtoolu_1"}
    assert api.post("/api/v1/tools/execute", json=body).status_code == 200
    job = ExecJob.objects.get(container_id=container)

    def killed(**_: object) -> None:
        raise _WorkerKilled

    monkeypatch.setattr(jobs, "_exec_job_close", killed)
    # This job's close alone: the session's other containers' jobs are idle this long too.
    idle = jobs.container_jobs_idle
    monkeypatch.setattr(jobs, "container_jobs_idle", lambda since: idle(since=since).filter(pk=job.pk))
    settings.PTC_CONTAINER_IDLE_SECONDS = 1
    time.sleep(1.2)
    with pytest.raises(_WorkerKilled):
        jobs.container_jobs_close_idle()
    closed = ExecJob.objects.get(pk=job.pk)
    assert closed.status == "completed" and closed.closed_at is not None
    assert not [name for _, name, _ in backplane().events_read(job.call_id) if name == "exec_end"]  # never sent
    # Followed until its end, or a deadline (its heartbeats, every second, would hold it for good).
    deadline = time.monotonic() + END_LOST_SECONDS + 10
    end: dict[str, Any] = {}
    with api.http.stream("GET", f"/api/v1/exec/{job.pk}/events", timeout=30) as response:
        event = ""
        for line in response.iter_lines():
            assert time.monotonic() < deadline, "no exec_end came"
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: ") and event == "exec_end":
                end = json.loads(line[6:])
                break
    assert (end["status"], end["finished_at"]) == ("completed", api.get(f"/api/v1/exec/{job.pk}").json()["finished_at"])
    assert [e["status"] for e in _logged_ends(job.call_id)] == ["completed"]  # the next reader's, in the log


@pytest.mark.parametrize("status", ["cancelled", "completed"])
def test_a_job_whose_worker_dies_while_its_end_waits_for_a_call_is_closed_by_the_reaper(
    api: Api, monkeypatch: pytest.MonkeyPatch, status: str
) -> None:
    """The worker stored a job's end as closed before it waited for its running calls: killed
    during that wait (up to a tool's timeout), it left the end never announced, and no one to
    announce it (the reaper closed only cancelled jobs not closed), so event streams followed it
    until its events were purged, and a client waiting for its end (POST /exec with ``wait``) slept
    out its wait. Now a job that made calls is closed by its close once they have ended, and the
    reaper closes it once the worker stops renewing its lease (and the call has ended); while the
    worker waits, renewing it, the reaper leaves it be."""
    from django.contrib.auth import get_user_model
    from django.utils import timezone

    from execution.models import ExecJob
    from execution.sandbox.session import Outcome
    from execution.services import jobs
    from execution.services.calls import tool_call_finish
    from tests.factories import demo_call, running_job

    user = get_user_model().objects.get(username=api.username)
    job = running_job(user=user, heartbeat_at=timezone.now())
    # Claimed by a tools worker that renews its lease (far ahead: none runs it here, and the stack's
    # reaper must not fail it as lost).
    ahead = timezone.now() + timedelta(hours=1)
    running = demo_call(user=user, job=job, tool="sleep", input={"ms": 1}, claimed_at=timezone.now(), heartbeat_at=ahead)
    if status == "cancelled":
        jobs.exec_job_cancel(job=job)

    def killed(**_: object) -> None:
        raise _WorkerKilled

    monkeypatch.setattr(jobs, "_running_calls_await", killed)
    outcome = Outcome(status=status, timings={"tool_calls": 1})
    with pytest.raises(_WorkerKilled):
        jobs.exec_job_finish(job_id=job.pk, call_id=job.call_id, outcome=outcome, user=user)
    assert ExecJob.objects.get(pk=job.pk).status == status
    long_ago = timezone.now() - timedelta(hours=1)
    try:
        # Its worker alive, waiting, renews the job's lease: the reaper leaves the job to it.
        ExecJob.objects.filter(pk=job.pk).update(finished_at=long_ago, heartbeat_at=timezone.now())
        jobs.exec_jobs_reap()
        assert ExecJob.objects.get(pk=job.pk).closed_at is None
        # Dead, it renews nothing: once its call has ended, the reaper closes the job and announces its end.
        ExecJob.objects.filter(pk=job.pk).update(heartbeat_at=long_ago)
    finally:
        assert tool_call_finish(call_id=running.call_id, output={"slept_ms": 1})  # as its tools worker does
    jobs.exec_jobs_reap()
    ends = _logged_ends(job.call_id)  # the stack's own workers reap too: one may have closed it first
    assert ExecJob.objects.get(pk=job.pk).closed_at is not None
    assert [(end["status"], [c["status"] for c in end["tool_calls"]]) for end in ends] == [(status, ["completed"])]


def test_jobs_that_ended_before_closing_was_recorded_are_taken_as_closed(api: Api) -> None:
    """The reaper closes any ended job not closed: jobs that ended before ``closed_at`` was written
    for them (it was for cancelled ones only) are marked closed by the migration that made it so,
    as they were; a job cancelled as it ran and not closed yet stays for its worker or the reaper."""
    import importlib

    from django.apps import apps
    from django.contrib.auth import get_user_model
    from django.utils import timezone

    from execution.models import ExecJob
    from tests.factories import running_job

    migration = importlib.import_module("execution.migrations.0012_execjob_ended_unclosed")
    user = get_user_model().objects.get(username=api.username)
    ended = timezone.now() - timedelta(days=30)
    # A lease just renewed: the stack's own reaper, closing ended jobs not closed, leaves them be.
    lease = {"started_at": ended, "finished_at": ended, "heartbeat_at": timezone.now(), "closed_at": None}
    old = [running_job(user=user, status=status, **lease) for status in ("completed", "failed", "timeout")]
    cancelled = running_job(user=user, status="cancelled", **lease)
    migration.ended_jobs_closed(apps, None)
    assert [job.closed_at for job in ExecJob.objects.filter(pk__in=[job.pk for job in old])] == [ended] * 3
    assert ExecJob.objects.get(pk=cancelled.pk).closed_at is None
    ExecJob.objects.filter(pk=cancelled.pk).update(closed_at=ended)  # not the stack's reaper's to close


def test_a_job_whose_worker_died_is_ended_once_the_calls_tools_workers_run_have_ended(api: Api) -> None:
    """The reaper ended a job whose exec worker died (WorkerLost) at once, announcing the calls
    tools workers were still running as executing and uncharged; they then completed and were
    charged. Now it ends the job once they have (or passed their tool's timeout plus grace)."""
    from django.contrib.auth import get_user_model
    from django.utils import timezone

    from billing.services import credits_reserve, price_quote
    from execution.models import ExecJob
    from execution.services import jobs
    from execution.services.calls import tool_call_finish
    from tests.factories import demo_call, running_job
    from tools.models import Tool

    user = get_user_model().objects.get(username=api.username)
    job = running_job(user=user, heartbeat_at=timezone.now())
    # Claimed by a tools worker that renews its lease (far ahead: none runs it here, and the stack's
    # reaper must not fail it as lost).
    ahead = timezone.now() + timedelta(hours=1)
    running = demo_call(user=user, job=job, tool="sleep", input={"ms": 1}, claimed_at=timezone.now(), heartbeat_at=ahead)
    tool = Tool.objects.select_related("toolset").get(toolset__key="demo", toolset__owner=None, name="sleep")
    quote = price_quote(user=user, toolset=tool.toolset, tool=tool)
    assert credits_reserve(user=user, holds=[(running.call_id, quote)], exec_job=job) == {}
    ExecJob.objects.filter(pk=job.pk).update(heartbeat_at=timezone.now() - timedelta(hours=1))  # its worker died
    try:
        jobs.exec_jobs_reap()
        assert ExecJob.objects.get(pk=job.pk).status == "running"
    finally:
        assert tool_call_finish(call_id=running.call_id, output={"slept_ms": 1})  # as its tools worker does
    jobs.exec_jobs_reap()
    ends = _logged_ends(job.call_id)  # the stack's own workers reap too: one may have ended it first
    [end] = ends
    assert (end["status"], end["error"]["type"]) == ("failed", "WorkerLost")
    assert [(c["status"], c["credits"]) for c in end["tool_calls"]] == [("completed", 1)]
    assert end["credits_charged"] == 1


def test_a_cancels_answer_waits_for_a_slow_call_no_longer_than_its_bound(api: Api) -> None:
    """A cancel's answer waited for the end, so for the calls a tools worker ran, up to their
    tool's timeout plus 30 s: a request held for minutes. It waits 10 s at most, then is the job
    as recorded, its call still running (14 s); exec_end still comes once the call has ended, with
    it charged. The call's state says the answer did not wait for it: a time under 13 s said the
    same, and a loaded machine's answer could be later."""
    code = CALLS_A_SLOW_TOOL.replace(f'"ms": {SLEEP_MS}', '"ms": 14000')
    job = api.run(code, toolsets=["demo"], wait=0)
    _running_call(api, job["id"])
    started = time.monotonic()
    cancelled = api.post(f"/api/v1/exec/{job['id']}/cancel")
    took = time.monotonic() - started
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled", cancelled.text
    assert took >= 9, took  # the end was waited for, its bound
    assert [c["status"] for c in cancelled.json()["tool_calls"]] == ["executing"]  # not the call
    events = list(sse_events(api, job["id"], timeout=30))
    assert events[-1][0] == "exec_end"
    assert _as_announced(events[-1][1])[1:] == ([(cancelled.json()["tool_calls"][0]["call_id"], "completed", 1)], 1)


def test_a_cancel_of_a_job_whose_worker_missed_its_beats_answers_at_once(api: Api) -> None:
    """Its worker dead (the lease not renewed for two beats, not yet lapsed for the reaper), no end
    comes for the cancel to wait for: it waited its whole bound (heartbeat and slack, 10 s by
    default) before answering with the job as recorded."""
    from django.contrib.auth import get_user_model
    from django.utils import timezone

    from tests.factories import running_job

    user = get_user_model().objects.get(username=api.username)
    # The stack beats every second and reaps a lease 4 s old: 2.5 s is two beats missed.
    job = running_job(user=user, started_at=timezone.now(), heartbeat_at=timezone.now() - timedelta(seconds=2.5))
    started = time.monotonic()
    cancelled = api.post(f"/api/v1/exec/{job.pk}/cancel")
    took = time.monotonic() - started
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled", cancelled.text
    assert took < 2.5, took


def test_a_close_retried_through_an_outage_claims_the_close_again_and_announces_the_end_once(api: Api, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A session's job that made no call is stored closed with its end (closed_at); its close then
    frees its session. That statement failing (the database away a moment), the claim is given back
    for the reaper, and the worker's retry of the close, with the job as it stored it, claims the
    close again and announces the end: once, and the job stays closed. Had the retry not claimed it
    again, the job was announced but left unclosed, and the reaper announced it a second time."""
    from datetime import timedelta as td

    from django.contrib.auth import get_user_model
    from django.db import OperationalError
    from django.utils import timezone

    from execution.models import ExecJob, ExecSession
    from execution.services import jobs
    from ptcproject.db import db_retry
    from tests.factories import running_job

    user = get_user_model().objects.get(username=api.username)
    now = timezone.now()
    session = ExecSession.objects.create(
        user=user,
        idle_timeout_seconds=60,
        max_lifetime_seconds=600,
        last_used_at=now,
        expires_at=now + td(minutes=1),
        max_expires_at=now + td(minutes=10),
    )
    job = running_job(user=user, session=session, status="completed", started_at=now, finished_at=now)
    stored = ExecJob.objects.get(pk=job.pk)
    assert stored.closed_at is not None
    failures, announced = [OperationalError("the database went away")], []
    session_job_ended, ended = jobs.exec_session_job_ended, jobs._exec_job_ended

    def session_job_ended_after_a_failure(**kwargs):  # type: ignore[no-untyped-def]
        if failures:
            raise failures.pop()
        return session_job_ended(**kwargs)

    monkeypatch.setattr(jobs, "exec_session_job_ended", session_job_ended_after_a_failure)
    monkeypatch.setattr(jobs, "_exec_job_ended", lambda job, **kwargs: announced.append(job.pk) or ended(job, **kwargs))
    db_retry(
        lambda: jobs._exec_job_close(job_id=job.pk, job=stored, bridge_calls=0, key_made=False),
        what="closing a job",
        job_id=job.pk,
    )
    assert announced == [job.pk]
    job.refresh_from_db()
    assert job.closed_at is not None  # not left for the reaper to close and announce again
    session.delete()


def test_a_queued_jobs_close_given_back_is_done_again_at_the_reapers_next_round(api: Api, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A job cancelled while queued is closed by its cancel, which frees its session. That statement
    failing (the session's row held locked past the statement timeout, the database away), the claim
    of its close is given back and the cancel answers an error: no one tries the close again. The
    reaper did only once a worker, alive, would have given up closing it (PTC_JOB_LEASE_SECONDS +
    PTC_DB_RETRY_SECONDS after its end: 64 s here, 105 s by default), though no worker ever took it;
    all that while its session answered 409 session_busy and its end was never announced to those
    waiting on it. Now the reaper's next round closes it, and announces its end once."""
    from django.db import OperationalError

    from execution.models import ExecJob, ExecSession
    from execution.services import jobs
    from tests.factories import running_job

    made = api.post("/api/v1/sessions", json={"toolsets": ["demo"]})
    assert made.status_code == 201, made.text
    session = ExecSession.objects.get(pk=made.json()["id"])
    # Queued on a queue no worker here reads (none takes it), as the session's one job.
    job = running_job(user=session.user, session=session, status="queued")
    ExecSession.objects.filter(pk=session.pk).update(current_job=job)

    def session_row_unavailable(**_: object) -> None:
        raise OperationalError("canceling statement due to statement timeout")

    with monkeypatch.context() as patched:
        patched.setattr(jobs, "exec_session_job_ended", session_row_unavailable)
        with pytest.raises(OperationalError):
            jobs.exec_job_cancel(job=job)
    assert ExecJob.objects.get(pk=job.pk).status == "cancelled"
    assert [end["status"] for end in _logged_ends(job.call_id)] == ["cancelled"]  # within 10 s
    assert ExecJob.objects.get(pk=job.pk).closed_at is not None
    after = api.run("1", session=str(session.pk))
    assert (after["status"], after["return_value"]) == ("completed", 1), after
