"""Retention: old finished jobs lose their code, output and tool I/O; every charge stays."""

import os
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from django.contrib.auth import get_user_model
from django.utils import timezone

from billing.models import CreditAccount, CreditUsage, LedgerEntry
from execution.backplane import LocalBackplane, RedisBackplane, backplane
from execution.models import ExecJob, ToolCall
from execution.services import retention
from execution.services.retention import PURGED, event_logs_expire, exec_jobs_purge
from ptcproject.accounts.models import UserSettings
from tests.conftest import Api
from tests.factories import demo_call, running_job
from tools.models import Tool

CODE = """
from ptc_tools.demo import Demo
print("secret output", Demo.add(a=20, b=22))
Demo.echo(value="private input")
"""


def _charges(username: str) -> dict[str, Any]:
    """What the user was charged, as the billing records say."""
    user = get_user_model().objects.get(username=username)
    return {
        "calls": sorted(
            ToolCall.objects.filter(user=user).values_list("call_id", "status", "credits", "toolset_key", "tool_name")
        ),
        "usage": sorted(CreditUsage.objects.filter(user=user).values_list("tool_call_id", "amount", "due_amount")),
        "ledger": sorted(LedgerEntry.objects.filter(account__user=user).values_list("id", "kind", "delta")),
        "balance": CreditAccount.objects.get(user=user).balance,
    }


def _assert_purged(job_id: str) -> None:
    job = ExecJob.objects.get(pk=job_id)
    assert job.purged_at is not None
    assert (job.code, job.stdout, job.stderr, job.return_value) == ("", "", "", None)
    calls = ToolCall.objects.filter(exec_job_id=job_id)
    assert calls.count() == 2
    assert all(call.input == {} and call.output is None for call in calls)


def test_zero_retention_purges_a_finished_job_by_beat_and_keeps_its_charges(make_api: Callable[..., Api]) -> None:
    private, keeper = make_api(), make_api()
    UserSettings.objects.create(user=get_user_model().objects.get(username=private.username), retention_days=0)
    job = private.run(CODE, toolsets=["demo"])
    kept = keeper.run(CODE, toolsets=["demo"])
    assert "secret output 42" in job["stdout"] and job["credits_charged"] == 1
    charges = _charges(private.username)

    deadline = time.monotonic() + 20
    while ExecJob.objects.get(pk=job["id"]).purged_at is None:  # beat's round, every second here
        assert time.monotonic() < deadline, "beat did not purge the zero-retention job"
        time.sleep(0.2)
    _assert_purged(job["id"])
    assert _charges(private.username) == charges  # ToolCall rows, usage, ledger and balance untouched

    seen = private.get(f"/api/v1/exec/{job['id']}").json()
    assert (seen["status"], seen["code"], seen["stdout"], seen["return_value"]) == ("completed", "", "", None)
    assert seen["credits_charged"] == 1
    assert "private input" not in private.get("/api/v1/tool-calls", params={"exec": job["id"]}).text
    if isinstance(backplane(), RedisBackplane):  # the live event log repeated the output: gone too
        assert backplane().events_read(job["call_id"]) == []

    other = ExecJob.objects.get(pk=kept["id"])  # a user without an override, and no default: kept
    assert other.purged_at is None and "secret output 42" in other.stdout
    assert ToolCall.objects.filter(exec_job_id=kept["id"], input={"value": "private input"}).exists()


def test_the_default_purges_only_jobs_past_it_in_batches_and_twice_is_a_no_op(
    make_api: Callable[..., Api], settings: Any
) -> None:
    api = make_api()
    old = [api.run(CODE, toolsets=["demo"]) for _ in range(3)]
    recent = api.run(CODE, toolsets=["demo"])
    standalone = api.post(
        "/api/v1/tools/execute", json={"toolset": "demo", "tool": "echo", "arguments": {"value": "kept?"}}
    ).json()
    ExecJob.objects.filter(pk__in=[j["id"] for j in old]).update(finished_at=timezone.now() - timedelta(days=8))
    ToolCall.objects.filter(call_id=standalone["call_id"]).update(finished_at=timezone.now() - timedelta(days=8))
    # One with nothing in or out but its error, whose message may quote an upstream's answer.
    failed = demo_call(
        user=get_user_model().objects.get(username=api.username),
        tool="echo",
        input={},
        status="failed",
        error={"code": "http_error", "message": "upstream said: private answer"},
        finished_at=timezone.now() - timedelta(days=8),
    )
    charges = _charges(api.username)

    settings.PTC_RETENTION_DAYS = None  # unset: nothing is purged
    exec_jobs_purge()
    assert all(ExecJob.objects.get(pk=j["id"]).purged_at is None for j in old)
    settings.PTC_RETENTION_DAYS = 7
    assert exec_jobs_purge(batch_size=1) >= 3  # one transaction per job here
    for job in old:
        _assert_purged(job["id"])
    assert ExecJob.objects.get(pk=recent["id"]).purged_at is None
    assert ToolCall.objects.get(call_id=standalone["call_id"]).input == {}
    failed.refresh_from_db()
    assert failed.error == {"code": "http_error", "message": PURGED}
    assert _charges(api.username) == charges
    assert exec_jobs_purge() == 0  # idempotent

    # Errors keep their type or code; their messages, which can quote data, go.
    failed = api.run(
        'from ptc_tools import ToolError\nfrom ptc_tools.demo import Demo\ntry:\n    Demo.fail(message="private")\nexcept ToolError:\n    pass\nraise ValueError("private too")',
        toolsets=["demo"],
    )
    assert failed["status"] == "failed"
    ExecJob.objects.filter(pk=failed["id"]).update(finished_at=timezone.now() - timedelta(days=8))
    assert exec_jobs_purge() == 1
    job = ExecJob.objects.get(pk=failed["id"])
    assert job.error == {"type": "ValueError", "message": "(removed by retention)", "traceback": ""}
    assert ToolCall.objects.get(exec_job_id=failed["id"]).error == {"code": "tool_failed", "message": "(removed by retention)"}

    # A user's own longer retention wins over the default.
    patient = make_api()
    UserSettings.objects.create(user=get_user_model().objects.get(username=patient.username), retention_days=30)
    theirs = patient.run(CODE, toolsets=["demo"])
    ExecJob.objects.filter(pk=theirs["id"]).update(finished_at=timezone.now() - timedelta(days=8))
    exec_jobs_purge()
    assert ExecJob.objects.get(pk=theirs["id"]).purged_at is None


def test_a_job_is_purged_once_its_calls_have_ended_and_a_late_record_brings_no_input() -> None:
    from execution.services import calls as services
    from tests.factories import demo_call, running_job

    user = get_user_model().objects.create_user(username=f"late-{uuid.uuid4().hex[:6]}")
    UserSettings.objects.create(user=user, retention_days=0)
    job = running_job(user=user)
    running = demo_call(user=user, job=job, claimed_at=timezone.now())  # a tools worker took it before the end
    ExecJob.objects.filter(pk=job.pk).update(status="cancelled", finished_at=timezone.now(), closed_at=timezone.now())
    exec_jobs_purge()
    assert ExecJob.objects.get(pk=job.pk).purged_at is None  # its call would write its output back
    services.tool_call_finish(call_id=running.call_id, output={"private": "output"})
    exec_jobs_purge()
    assert ExecJob.objects.get(pk=job.pk).purged_at is not None
    assert ToolCall.objects.get(pk=running.pk).output is None
    # A call queued when the job's worker died, taken by a tools worker after the purge: recorded as
    # never run, its input not brought back.
    tool = Tool.objects.select_related("toolset").get(toolset__key="demo", toolset__owner=None, name="echo")
    queued = services.tool_call_build(
        call_id=f"ptc_{uuid.uuid4().hex}",
        user=user,
        job=job,
        toolset="demo",
        tool="echo",
        arguments={"value": "private"},
        found=tool,
    )
    services.tool_call_execute(call_id=queued.call_id, record=services.tool_call_signed(queued))
    late = ToolCall.objects.get(call_id=queued.call_id)
    assert (late.status, late.error["code"], late.input) == ("failed", "job_ended", {})


def test_a_retention_of_thousands_of_years_keeps_that_user_and_purges_everyone_else() -> None:
    """The admin takes any retention_days its column holds: one user's 1,000,000 days (more than
    the calendar reaches back from today) keeps their jobs, and stops nobody else's purge."""
    from tests.factories import running_job

    keeper, other = (get_user_model().objects.create_user(username=f"{n}-{uuid.uuid4().hex[:6]}") for n in ("k", "o"))
    UserSettings.objects.create(user=keeper, retention_days=1_000_000)
    UserSettings.objects.create(user=other, retention_days=0)
    ended = {"status": "completed", "code": "print('private')", "finished_at": timezone.now() - timedelta(seconds=1)}
    kept, purged = running_job(user=keeper, **ended), running_job(user=other, **ended)
    exec_jobs_purge()
    assert ExecJob.objects.get(pk=purged.pk).purged_at is not None
    assert ExecJob.objects.get(pk=kept.pk).code == "print('private')"


def test_embedded_event_logs_go_once_idle_past_retention_and_their_job_ended(
    tmp_path: Any, settings: Any, monkeypatch: Any
) -> None:
    """The embedded backplane's logs are files: the retention round drops those of jobs that ended
    (or are gone) once not written for PTC_EVENTS_RETENTION_SECONDS, and keeps a running job's."""
    settings.DATA_DIR = tmp_path
    plane = LocalBackplane()
    monkeypatch.setattr(retention, "backplane", lambda: plane)
    user = get_user_model().objects.create_user(username=f"logs-{uuid.uuid4().hex[:6]}")
    now = timezone.now()
    ended = running_job(user=user, status="completed", finished_at=now)
    running = running_job(user=user, started_at=now, heartbeat_at=now)
    fresh = running_job(user=user, status="failed", finished_at=now)
    gone = f"exec_{uuid.uuid4().hex}"
    for call_id in (ended.call_id, running.call_id, fresh.call_id, gone):
        plane.events_append(call_id, [("exec_start", {"id": call_id}), ("stdout", {"text": "hi"})])
    old = time.time() - settings.PTC_EVENTS_RETENTION_SECONDS - 5
    for call_id in (ended.call_id, running.call_id, gone):
        os.utime(tmp_path / "events" / f"{call_id}.log", (old, old))

    assert event_logs_expire() == 2
    assert plane.events_read(ended.call_id) == [] and plane.events_read(gone) == []
    assert [name for _, name, _ in plane.events_read(running.call_id)] == ["exec_start", "stdout"]
    assert [name for _, name, _ in plane.events_read(fresh.call_id)] == ["exec_start", "stdout"]
    assert event_logs_expire() == 0


def test_embedded_event_logs_stay_while_their_job_is_not_closed_or_a_call_of_it_runs(
    tmp_path: Any, settings: Any, monkeypatch: Any
) -> None:
    """A job that has ended is still written to until it is closed (its close waits for its running
    calls, then appends its end; the reaper's reads a cancelled job's output from the log) and while
    a call of it outlives it. Its log, idle past the retention as a long call ran, was dropped: the
    end went to a new file, past which its readers' offsets were. Kept until then, as a purge waits."""
    settings.DATA_DIR = tmp_path
    plane = LocalBackplane()
    monkeypatch.setattr(retention, "backplane", lambda: plane)
    user = get_user_model().objects.create_user(username=f"logs-{uuid.uuid4().hex[:6]}")
    now = timezone.now()
    unclosed = running_job(user=user, status="cancelled", started_at=now, finished_at=now, closed_at=None)
    calling = running_job(user=user, status="timeout", finished_at=now)
    demo_call(user=user, job=calling, tool="sleep", input={"ms": 10})
    closed = running_job(user=user, status="completed", finished_at=now)
    old = time.time() - settings.PTC_EVENTS_RETENTION_SECONDS - 5
    for job in (unclosed, calling, closed):
        plane.events_append(job.call_id, [("exec_start", {"id": str(job.pk)}), ("stdout", {"text": "hi"})])
        os.utime(tmp_path / "events" / f"{job.call_id}.log", (old, old))

    assert event_logs_expire() == 1
    assert plane.events_read(closed.call_id) == []
    for job in (unclosed, calling):
        assert [name for _, name, _ in plane.events_read(job.call_id)] == ["exec_start", "stdout"]


def test_beat_purges_jobs_past_retention_when_the_event_logs_cannot_be_listed(
    tmp_path: Any, settings: Any, monkeypatch: Any
) -> None:
    """Beat's retention round expires the embedded event logs, then purges the jobs past their
    owners' retention. A folder of logs that can't be listed (another user's, mode 0700; here, a
    file where the folder should be) raised there, every round, and no job was ever purged: the
    code, output and tool I/O a user asked to have dropped were kept."""
    from execution import tasks

    settings.DATA_DIR = tmp_path
    (tmp_path / "events").write_text("")
    plane = LocalBackplane()
    monkeypatch.setattr(retention, "backplane", lambda: plane)
    user = get_user_model().objects.create_user(username=f"logs-{uuid.uuid4().hex[:6]}")
    UserSettings.objects.create(user=user, retention_days=0)
    ended = timezone.now() - timedelta(minutes=1)
    job = running_job(user=user, status="completed", started_at=ended, finished_at=ended, code="print('private')")

    tasks.purge_jobs.run()  # beat's round, as its worker runs it
    assert ExecJob.objects.get(pk=job.pk).purged_at is not None
