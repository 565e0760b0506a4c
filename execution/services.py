"""Writes for exec jobs and tool calls: create, run, cancel, finish, reap; submit and run a call."""

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import jsonschema
from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.db import DatabaseError, InterfaceError, OperationalError, connection, transaction
from django.db.models import OuterRef, Subquery
from django.db.models.functions import Coalesce
from django.utils import timezone

from billing.models import Reservation
from billing.services import (
    CreditsRefused,
    billable,
    call_complete_and_settle,
    credits_release,
    credits_reserve,
    credits_settle,
    price_quote,
    reservations_repair,
)
from execution import channels
from execution.events import (
    event_publish,
    events_publish,
    job_end_payload,
    job_start_payload,
    output_from_stream,
    tool_call_event,
    tool_call_payload,
)
from execution.models import ExecJob, ToolCall
from execution.sandbox.limits import Limits
from execution.sandbox.process import SandboxUnavailable
from execution.sandbox.session import CALL_GRACE_SECONDS, Dispatched, Outcome, Refused, Session
from ptcproject.accounts.models import ApiKey
from ptcproject.accounts.services import api_key_create, job_keys_revoke
from ptcproject.errors import ApplicationError
from ptcproject.policy.models import Policy
from ptcproject.policy.selectors import policy_get, ptc_decision
from ptcproject.storage import MAX_JSON_DEPTH, json_depth_exceeds, storable
from tools.errors import ToolFailure
from tools.kinds import tool_run
from tools.models import Tool, Toolset
from tools.sdk import sdk_prepare
from tools.selectors import tool_for_call, tool_is_ptc, toolset_keys_for_ptc, toolsets_named, toolsets_resolve

logger = logging.getLogger("ptc.execution")
Status = ExecJob.Status
T = TypeVar("T")


def job_limits(*, policy: Policy, timeout: float) -> Limits:
    """Return the limits a new job runs under: the policy's, one call at a time if it is sequential."""
    return Limits(
        timeout=timeout,
        memory_mb=policy.memory_limit_mb,
        max_output_bytes=policy.max_output_bytes,
        max_tool_calls=policy.max_tool_calls,
        max_parallel_tool_calls=1 if policy.sequential else policy.max_parallel_tool_calls,
        max_processes=settings.PTC_MAX_PROCESSES,
        max_file_mb=settings.PTC_MAX_FILE_MB,
        max_open_files=settings.PTC_MAX_OPEN_FILES,
    )


# -- Jobs ----------------------------------------------------------------------------------------
def exec_job_create(
    *,
    user: AbstractBaseUser,
    code: str,
    toolsets: list[str] | None,
    timeout: float | None,
    title: str = "",
    max_credits: int | None = None,
) -> ExecJob:
    """Check the request against the policy, record the job as ``queued``, and enqueue it once committed.

    Raise ApplicationError: ``code_too_large`` (413), ``validation_error`` for a timeout above the
    policy's maximum (400; never clamped), ``unknown_toolset`` (400), ``ptc_disabled`` (403),
    ``broker_unavailable`` (503, and the job is not created).
    """
    size = len(code.encode())
    if size > settings.PTC_MAX_CODE_BYTES:
        raise ApplicationError(
            "code_too_large",
            f"The code is {size} bytes; the limit is {settings.PTC_MAX_CODE_BYTES}. Send less code.",
            status=413,
            details={"size": size, "limit": settings.PTC_MAX_CODE_BYTES},
        )
    policy = policy_get()
    if timeout is None:
        timeout = policy.default_timeout
    if timeout > policy.max_timeout:
        raise ApplicationError(
            "validation_error",
            f"timeout {timeout:g} s is above the maximum of {policy.max_timeout} s.",
            details={"timeout": [f"Ensure this value is less than or equal to {policy.max_timeout}."]},
        )
    if toolsets is None:
        # Every toolset the user may use with PTC: the policy's lists narrow what they can see.
        keys = toolset_keys_for_ptc(user=user, allowlist=policy.toolset_allowlist, blocklist=policy.toolset_blocklist)
    else:
        keys = [ts.key for ts in toolsets_named(user=user, keys=toolsets)]  # unknown_toolset (400) if any is not
    decision = ptc_decision(policy=policy, user=user, toolsets=keys, title=title)
    if not decision.enabled:
        raise ApplicationError(
            "ptc_disabled", f"PTC is disabled here: {decision.reason}.", status=403, details={"reason": decision.reason}
        )
    with transaction.atomic():
        job = ExecJob.objects.create(
            user=user,
            code=code,
            toolsets=keys,
            title=title,
            timeout_seconds=timeout,
            limits=job_limits(policy=policy, timeout=timeout).as_dict(),
            sequential=policy.sequential,
            max_credits=max_credits,
        )
        transaction.on_commit(lambda: _exec_job_enqueue(job=job))
    logger.info("job queued", extra={"job_id": str(job.id)})
    return job


def _exec_job_enqueue(*, job: ExecJob) -> None:
    """Send a committed job to the exec queue. If the broker can't take it, the job is withdrawn
    and ApplicationError ``broker_unavailable`` (503) raised: a client is never told a job failed
    while it waits queued for ever."""
    from execution.tasks import run_exec

    try:
        run_exec.delay(str(job.pk))
    except Exception as exc:  # the broker is unreachable even after Celery's own retries
        logger.warning("could not enqueue a job; withdrawn", extra={"job_id": str(job.pk)}, exc_info=True)
        withdrawn, _ = ExecJob.objects.filter(pk=job.pk, status=Status.QUEUED).delete()
        if withdrawn:
            raise ApplicationError(
                "broker_unavailable",
                "The job could not be queued: the message broker is unreachable. Nothing was run; try again.",
                status=503,
            ) from exc
        # It was taken after all: the message went out before the error.


def _db_reset() -> None:
    """Drop this thread's database connection, broken or not: the next query takes a fresh one."""
    try:
        connection.close()
    except DatabaseError:
        pass


def _db_retry(work: Callable[[], T], *, what: str, job_id: Any) -> T:
    """Run ``work``; while the database is unreachable, retry it on a fresh connection with backoff,
    for up to PTC_DB_RETRY_SECONDS. Raise the last error after that."""
    deadline = time.monotonic() + settings.PTC_DB_RETRY_SECONDS
    delay = 0.2
    while True:
        try:
            return work()
        except (OperationalError, InterfaceError):
            if time.monotonic() + delay > deadline:
                raise
            logger.warning("database unreachable while %s; retrying in %.1f s", what, delay, extra={"job_id": str(job_id)})
            _db_reset()
            time.sleep(delay)
            delay = min(delay * 2, 5.0)


def exec_job_run(*, job_id: str, worker: str) -> None:
    """Run a queued job in a sandbox to its end. A redelivered job that was running fails as WorkerLost.

    Only the claim may raise (a database error: the task retries it). Whatever happens after the
    claim, the job's end is recorded.
    """
    now = timezone.now()
    claimed = ExecJob.objects.filter(pk=job_id, status=Status.QUEUED).update(
        status=Status.RUNNING, started_at=now, heartbeat_at=now, worker=worker
    )
    if not claimed:
        # Running with a stale heartbeat means the worker that took it died and the broker
        # redelivered it: the code may have had effects, so it is not run twice. A fresh heartbeat
        # means its worker is alive, and this delivery is a duplicate to drop.
        _exec_job_fail_if(
            job_id=job_id,
            status=Status.RUNNING,
            kind="WorkerLost",
            message="the worker running this job stopped; it was not run again",
            stale=True,
        )
        return
    try:
        outcome = _exec_job_sandbox(job_id=job_id)
    except Exception as exc:  # the job must end, never stay running
        logger.exception("the job's run failed", extra={"job_id": job_id})
        outcome = Outcome(status="failed", error=_error("InternalError", f"the worker failed while running the job: {exc}"))
    exec_job_finish(job_id=job_id, outcome=outcome)


def _error(kind: str, message: str) -> dict[str, str]:
    return {"type": kind, "message": message, "traceback": ""}


def _exec_job_sandbox(*, job_id: str) -> Outcome:
    """Run a claimed job's code in a sandbox and return what happened."""
    # Nothing has run yet: a database that drops meanwhile (a restart) is waited for, not the job's end.
    prepared = _db_retry(lambda: _exec_job_prepare(job_id=job_id), what="preparing a job", job_id=job_id)
    if isinstance(prepared, Outcome):
        return prepared
    job, router, sdk_dir, job_key = prepared
    event_publish(job_call_id=job.call_id, event="exec_start", data=job_start_payload(job))
    limits = Limits.from_dict(job.limits)
    with channels.subscribe(channels.job_channel(job.call_id)) as channel:
        # A cancel that landed between the claim and the subscription would otherwise be missed.
        if ExecJob.objects.filter(pk=job.pk, status=Status.CANCELLED).exists():
            return Outcome(status="cancelled")
        session = Session(
            code=job.code,
            limits=limits,
            sdk_dir=sdk_dir,
            router=router,
            channel=channel,
            heartbeat=lambda: _exec_job_heartbeat(job_id=job.pk),
            heartbeat_every=settings.PTC_JOB_HEARTBEAT_SECONDS,
            max_frame=settings.PTC_MAX_FRAME_BYTES,
            max_buffered=settings.PTC_MAX_BUFFERED_BYTES,
            job_info={"call_id": job.call_id, "key": job_key},
            on_output=lambda stream, text: event_publish(job_call_id=job.call_id, event=stream, data={"text": text}),
        )
        try:
            outcome = session.run()
        except SandboxUnavailable as exc:
            logger.error("this host cannot run sandboxes: %s", exc, extra={"job_id": job_id})
            outcome = Outcome(status="failed", error=_error("SandboxCrashed", str(exc)))
        except Exception as exc:  # the worker survives anything a sandbox does; the job records it
            logger.exception("sandbox failed", extra={"job_id": job_id})
            outcome = Outcome(status="failed", error=_error("SandboxCrashed", str(exc)))
    outcome.timings["queue_ms"] = round((job.started_at - job.created_at).total_seconds() * 1000, 2)
    return outcome


def _exec_job_prepare(*, job_id: str) -> "tuple[ExecJob, JobCallRouter, Path, str] | Outcome":
    """Load a claimed job, build its SDK, its call router and its job-scoped key. Return those, or
    the Outcome that ends the job if its SDK can't be built. Safe to run again."""
    job = ExecJob.objects.select_related("user").get(pk=job_id)
    policy = policy_get()
    toolsets, _ = toolsets_resolve(user=job.user, keys=job.toolsets)
    try:
        sdk_hash, sdk_dir = sdk_prepare(toolsets=toolsets)
    except (OperationalError, InterfaceError):
        raise
    except Exception as exc:  # said in the job's error
        logger.exception("sdk generation failed", extra={"job_id": job_id})
        return Outcome(status="failed", error=_error("SandboxCrashed", f"the SDK could not be generated: {exc}"))
    ExecJob.objects.filter(pk=job.pk).update(sdk_hash=sdk_hash)
    router = JobCallRouter(job=job, toolsets=toolsets, direct_only=frozenset(policy.direct_only_tools))
    # What a sandbox on another host would call back with (POST /api/v1/tools/execute); it dies with the job.
    _, job_key = api_key_create(
        user=job.user,
        name=f"job {job.call_id}",
        exec_job=job,
        expires_at=timezone.now() + timedelta(seconds=job.timeout_seconds + 60),
    )
    return job, router, sdk_dir, job_key


def _exec_job_heartbeat(*, job_id: Any) -> bool:
    """Renew a running job's lease. Return False if the job is no longer running (cancelled, or
    reaped while its worker stalled): its sandbox must stop. A database outage is not the job's end:
    the lease outlasts a short one, so this says go on."""
    try:
        return bool(ExecJob.objects.filter(pk=job_id, status=Status.RUNNING).update(heartbeat_at=timezone.now()))
    except (OperationalError, InterfaceError):
        logger.warning("could not renew the job's lease: the database is unreachable", extra={"job_id": str(job_id)})
        _db_reset()
        return True


def exec_job_finish(*, job_id: Any, outcome: Outcome) -> None:
    """Record the outcome of a running job, close it and announce its end. A cancelled job stays
    cancelled, with what the code printed.

    While the database is unreachable it retries (PTC_DB_RETRY_SECONDS); a value it cannot store
    ends the job failed with a short error. If the database stays away longer, the job's lease
    lapses and the reaper ends it once it is back: it never stays running.
    """
    if json_depth_exceeds(outcome.return_value):  # the sandbox's runner checks too; this is the guard
        outcome.status, outcome.return_value = "failed", None
        outcome.error = _error("ResourceLimit", f"the return value nests deeper than {MAX_JSON_DEPTH} levels")
    now = timezone.now()
    output = {
        "stdout": storable(outcome.stdout),
        "stderr": storable(outcome.stderr),
        "stdout_truncated": outcome.stdout_truncated,
        "stderr_truncated": outcome.stderr_truncated,
        "timings": outcome.timings,
    }
    result = {"status": outcome.status, "return_value": storable(outcome.return_value), "error": storable(outcome.error)}

    def store() -> None:
        try:
            with transaction.atomic():
                if not ExecJob.objects.filter(pk=job_id, status=Status.RUNNING).update(finished_at=now, **result, **output):
                    # Cancelled while it ran: keep that status, but keep what the code printed too.
                    ExecJob.objects.filter(pk=job_id, status=Status.CANCELLED).update(**output)
        except (OperationalError, InterfaceError):
            raise
        except DatabaseError:  # the value itself can't be stored: the job still ends, and says why
            logger.exception("could not store a job's outcome", extra={"job_id": str(job_id)})
            error = _error("InternalError", "the job's output could not be stored")
            ExecJob.objects.filter(pk=job_id, status=Status.RUNNING).update(status=Status.FAILED, error=error, finished_at=now)

    try:
        _db_retry(store, what="storing a job's outcome", job_id=job_id)
        job = _db_retry(lambda: _exec_job_close(job_id=job_id), what="closing a job", job_id=job_id)
    except DatabaseError:
        logger.exception("could not record a job's end; the reaper will", extra={"job_id": str(job_id)})
        return
    logger.info("job finished", extra={"job_id": str(job_id), "status": job.status, **outcome.timings})


def _exec_job_close(*, job_id: Any) -> ExecJob:
    """What follows every job's end, however it ended: its job key is revoked, its calls still
    queued fail as never run (a tools worker that claimed one finishes it), and its end is
    announced. Idempotent. Return the job."""
    job = ExecJob.objects.select_related("user").get(pk=job_id)
    job_keys_revoke(exec_job_id=job.pk)
    ToolCall.objects.filter(exec_job=job, status=ToolCall.Status.EXECUTING, claimed_at__isnull=True).update(
        status=ToolCall.Status.FAILED,
        error={"code": "job_ended", "message": "the job ended before this call started; it was not run"},
        finished_at=timezone.now(),
    )
    _exec_job_ended(job)
    return job


def _exec_job_ended(job: ExecJob) -> str:
    """Announce a job's end: its last event, then the channel's ``end`` that wakes ``wait``. Return its status."""
    final = job_end_payload(job)
    event_publish(job_call_id=job.call_id, event="exec_end", data=final)
    channels.publish(channels.job_channel(job.call_id), {"kind": "end", "status": final["status"]})
    return final["status"]


def _exec_job_fail_if(*, job_id: str, status: str, kind: str, message: str, stale: bool = False) -> bool:
    """Fail the job if it is still in ``status`` (and, with ``stale``, its heartbeat has lapsed)."""
    jobs = ExecJob.objects.filter(pk=job_id, status=status)
    if stale:
        jobs = jobs.filter(heartbeat_at__lt=timezone.now() - timedelta(seconds=settings.PTC_JOB_LEASE_SECONDS))
    updated = jobs.update(status=Status.FAILED, finished_at=timezone.now(), error=_error(kind, message))
    if updated and status == Status.RUNNING:
        # Its worker died holding the output in memory; what the code printed went out as events.
        call_id = ExecJob.objects.values_list("call_id", flat=True).get(pk=job_id)
        output = {name: storable(text) for name, text in output_from_stream(job_call_id=call_id).items()}
        if output:
            ExecJob.objects.filter(pk=job_id).update(**output)
    if updated:
        _exec_job_close(job_id=job_id)
    return bool(updated)


def exec_job_cancel(*, job: ExecJob) -> ExecJob:
    """Cancel a queued or running job: its sandbox is killed and its unstarted tool calls never run.

    Raise ApplicationError ``job_finished`` (409) if it has already ended.
    """
    cancelled = {
        "status": Status.CANCELLED,
        "finished_at": timezone.now(),
        "error": {"type": "Cancelled", "message": "the job was cancelled", "traceback": ""},
    }
    was_queued = ExecJob.objects.filter(pk=job.pk, status=Status.QUEUED).update(**cancelled)
    was_running = not was_queued and ExecJob.objects.filter(pk=job.pk, status=Status.RUNNING).update(**cancelled)
    job.refresh_from_db()
    if not (was_queued or was_running):
        raise ApplicationError("job_finished", f"The job has already finished with status '{job.status}'.", status=409)
    if was_queued:
        _exec_job_close(job_id=job.pk)  # no worker will: it never started
    else:
        job_keys_revoke(exec_job_id=job.pk)
        # Its worker kills the sandbox and ends the job; if this push is lost, its next heartbeat
        # finds the job cancelled.
        channels.publish(channels.job_channel(job.call_id), {"kind": "cancel"})
    return job


def exec_jobs_reap() -> int:
    """Fail running jobs whose worker stopped renewing their lease, calls whose tools worker did
    the same, and calls abandoned otherwise. Return how many jobs were failed."""
    # Reservations of calls whose worker died between running and settling: the record decides.
    reservations_repair(older_than_seconds=settings.PTC_JOB_LEASE_SECONDS)
    stale = timezone.now() - timedelta(seconds=settings.PTC_JOB_LEASE_SECONDS)
    lapsed = (
        ToolCall.objects.filter(status=ToolCall.Status.EXECUTING, claimed_at__isnull=False)
        .annotate(lease=Coalesce("heartbeat_at", "claimed_at"))
        .filter(lease__lt=stale)
    )
    for call_id, ptc_call_id in lapsed.values_list("call_id", "ptc_call_id"):
        logger.warning("a tools worker stopped renewing a call's lease; failing it", extra={"call_id": call_id})
        reply = _tool_call_fail(call_id, "worker_lost", "the tools worker running this call stopped; it was not run again")
        channels.publish(_result_channel(call_id, ptc_call_id), {"kind": "result", "call_id": call_id, **reply})
    abandoned = timezone.now() - timedelta(seconds=settings.PTC_DEFAULT_TOOL_TIMEOUT * 2 + settings.PTC_JOB_LEASE_SECONDS)
    ToolCall.objects.filter(status=ToolCall.Status.EXECUTING, started_at__lt=abandoned).exclude(
        exec_job__status=Status.RUNNING
    ).update(
        status=ToolCall.Status.FAILED,
        error={"code": "worker_lost", "message": "no tools worker finished this call; it was abandoned"},
        finished_at=timezone.now(),
    )
    lost = timezone.now() - timedelta(seconds=settings.PTC_QUEUED_MAX_SECONDS)
    for job_id in ExecJob.objects.filter(status=Status.QUEUED, created_at__lt=lost).values_list("pk", flat=True):
        _exec_job_fail_if(
            job_id=str(job_id),
            status=Status.QUEUED,
            kind="WorkerLost",
            message=f"no exec worker took the job within {settings.PTC_QUEUED_MAX_SECONDS} s; its queue message was lost",
        )
    reaped = 0
    for job_id in ExecJob.objects.filter(status=Status.RUNNING, heartbeat_at__lt=stale).values_list("pk", flat=True):
        reaped += _exec_job_fail_if(
            job_id=str(job_id),
            stale=True,
            status=Status.RUNNING,
            kind="WorkerLost",
            message="the worker running this job stopped renewing its lease; the job was ended",
        )
    return reaped


def worker_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


# -- Tool calls ----------------------------------------------------------------------------------
class CallChecker:
    """Checks one tool call before it runs: toolset granted, tool known (and callable from code when
    ``ptc_only``), arguments valid against the tool's JSON Schema. Validators are kept per tool."""

    def __init__(self, *, user: AbstractBaseUser, toolsets: list[Toolset], direct_only: frozenset[str], ptc_only: bool) -> None:
        self.user = user
        self.toolsets = {ts.key: ts for ts in toolsets}
        self.direct_only = direct_only
        self.ptc_only = ptc_only
        self.validators: dict[Any, Any] = {}

    def check(self, toolset_key: str, tool_name: str, arguments: Any) -> Tool:
        """Return the tool to run, or raise ToolFailure with a stable code."""
        toolset = self.toolsets.get(toolset_key)
        if toolset is None:
            if toolsets_resolve(user=self.user, keys=[toolset_key])[0]:
                raise ToolFailure("toolset_not_granted", f"toolset '{toolset_key}' was not granted to this job")
            raise ToolFailure("unknown_toolset", f"there is no toolset '{toolset_key}'")
        tool = next((t for t in toolset.tools.all() if t.name == tool_name), None)
        if tool is None:
            raise ToolFailure("unknown_tool", f"toolset '{toolset_key}' has no tool '{tool_name}'")
        if self.ptc_only and not tool_is_ptc(tool=tool, toolset=toolset, direct_only=self.direct_only):
            raise ToolFailure("tool_not_ptc", f"'{toolset_key}.{tool_name}' is a direct tool and cannot be called from code")
        if not isinstance(arguments, dict):
            raise ToolFailure("invalid_arguments", "arguments must be a JSON object of keyword arguments")
        if json_depth_exceeds(arguments):  # before the schema: its validator recurses
            raise ToolFailure("invalid_arguments", f"arguments nest deeper than {MAX_JSON_DEPTH} levels")
        validator = self.validators.get(tool.pk)
        if validator is None:
            cls = jsonschema.validators.validator_for(tool.input_schema)
            validator = self.validators[tool.pk] = cls(tool.input_schema, format_checker=cls.FORMAT_CHECKER)
        error = jsonschema.exceptions.best_match(validator.iter_errors(arguments))
        if error is not None:
            where = "/".join(str(p) for p in error.absolute_path) or "arguments"
            raise ToolFailure("invalid_arguments", f"{where}: {error.message}")
        return tool


def _tool_call_build(
    *,
    call_id: str,
    user: AbstractBaseUser,
    job: ExecJob | None,
    toolset: str,
    tool: str,
    arguments: Any,
    found: Tool | None,
    error: dict[str, str] | None = None,
) -> ToolCall:
    """Return the call's record, unsaved: ``executing``, or ``failed`` already if it was refused."""
    now = timezone.now()
    return ToolCall(
        call_id=call_id,
        type=ToolCall.Type.PTC if job else ToolCall.Type.STANDALONE,
        exec_job=job,
        ptc_call_id=job.call_id if job else "",
        user=user,
        toolset_key=toolset[:64],
        tool_name=tool[:128],
        tool=found,
        input=storable(arguments if isinstance(arguments, dict) else {"value": arguments}),
        status=ToolCall.Status.FAILED if error else ToolCall.Status.EXECUTING,
        error=error,
        started_at=now,
        finished_at=now if error else None,
    )


def _tool_calls_record(calls: list[ToolCall]) -> None:
    """Write records before their calls run, in one INSERT, and publish their start events (and the
    errors of refused ones) in one round trip."""
    ToolCall.objects.bulk_create(calls)
    by_job: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    for call in calls:
        if call.ptc_call_id:
            events = by_job.setdefault(call.ptc_call_id, [])
            events.append(("tool_call_start", tool_call_payload(call)))
            if call.status == ToolCall.Status.FAILED:
                events.append(tool_call_event(call))
    for job_call_id, events in by_job.items():
        events_publish(job_call_id=job_call_id, events=events)


def _tool_call_record(**fields: Any) -> ToolCall:
    call = _tool_call_build(**fields)
    _tool_calls_record([call])
    return call


def _tool_call_event(call: ToolCall) -> None:
    if call.ptc_call_id:
        name, data = tool_call_event(call)
        event_publish(job_call_id=call.ptc_call_id, event=name, data=data)


def _tool_calls_enqueue(call_ids: list[str]) -> dict[str, dict[str, str]]:
    """Send calls to the tools queue through one producer. Return the errors of those that failed
    (their records are failed too): the broker was down even after Celery's own retries."""
    from tools.tasks import execute_tool

    errors = {}
    with execute_tool.app.producer_or_acquire() as producer:
        for call_id in call_ids:
            try:
                execute_tool.apply_async((call_id,), producer=producer)
            except Exception as exc:  # this call's failure; the others may still go
                logger.exception("could not enqueue a tool call", extra={"call_id": call_id})
                errors[call_id] = {
                    "code": "broker_unavailable",
                    "message": f"the call could not be queued ({type(exc).__name__}); retry",
                }
                _tool_call_finish(call_id=call_id, error=errors[call_id])
    return errors


def _tool_call_enqueue(*, call_id: str) -> dict[str, str] | None:
    return _tool_calls_enqueue([call_id]).get(call_id)


class JobCallRouter:
    """Checks and dispatches one job's tool calls from its sandbox: check, record, enqueue."""

    def __init__(self, *, job: ExecJob, toolsets: list[Toolset], direct_only: frozenset[str]) -> None:
        self.job = job
        granted = [ts for ts in toolsets if ts.key in job.toolsets]
        self.checker = CallChecker(user=job.user, toolsets=granted, direct_only=direct_only, ptc_only=True)
        self.quotes: dict[Any, Any] = {}

    def submit_many(self, requests: list[tuple[str, str, Any]]) -> list[Dispatched | Refused]:
        """Check, record, reserve and enqueue a burst of calls ``(toolset, tool, arguments)``: one
        INSERT, one round trip of events, one producer. Return each one's outcome, in order."""
        try:
            return self._submit_many(requests)
        finally:
            connection.close()  # this runs on a session's submit thread: give its connection back to the pool

    def _submit_many(self, requests: list[tuple[str, str, Any]]) -> list[Dispatched | Refused]:
        calls, found_tools, outcomes = [], [], []
        for toolset, tool, arguments in requests:
            fields = {
                "call_id": f"ptc_{uuid.uuid4().hex}",
                "user": self.job.user,
                "job": self.job,
                "toolset": toolset,
                "tool": tool,
                "arguments": arguments,
            }
            try:
                found = self.checker.check(toolset, tool, arguments)
                calls.append(_tool_call_build(**fields, found=found))
            except ToolFailure as failure:
                found = None
                calls.append(_tool_call_build(**fields, found=None, error=failure.as_dict()))
            found_tools.append(found)
        _tool_calls_record(calls)
        accepted = []
        for call, found in zip(calls, found_tools, strict=True):
            if found is None:
                outcomes.append(Refused(call_id=call.call_id, error=call.error))
                continue
            error = _tool_call_reserve(call_id=call.call_id, user=self.job.user, tool=found, job=self.job, quotes=self.quotes)
            if error:
                outcomes.append(Refused(call_id=call.call_id, error=error))
            else:
                outcomes.append(Dispatched(call_id=call.call_id, timeout=found.timeout or settings.PTC_DEFAULT_TOOL_TIMEOUT))
                accepted.append(call.call_id)
        errors = _tool_calls_enqueue(accepted)
        return [Refused(call_id=o.call_id, error=errors[o.call_id]) if o.call_id in errors else o for o in outcomes]

    def lookup(self, *, call_id: str) -> dict[str, Any] | None:
        """Return the reply for a call that has finished, from its record; None while it runs (or
        while the database can't say: the call's deadline still holds)."""
        try:
            call = ToolCall.objects.filter(call_id=call_id).exclude(status=ToolCall.Status.EXECUTING).first()
        except (OperationalError, InterfaceError):
            _db_reset()
            return None
        return None if call is None else _reply(call)

    def overdue(self, *, call_id: str) -> dict[str, Any]:
        # The hand-off was lost or the call is stuck: the record decides. A late tools worker
        # finds the call failed and its result is dropped.
        error = {"code": "tool_timeout", "message": CALL_TIMEOUT_MESSAGE}
        try:
            _tool_call_finish(call_id=call_id, error=error)
            return _reply(ToolCall.objects.get(call_id=call_id))
        except (OperationalError, InterfaceError):
            # The code gets its answer now; the record, still executing, is failed by the reaper.
            logger.warning("could not record an overdue call: the database is unreachable", extra={"call_id": call_id})
            _db_reset()
            return {"ok": False, "error": error}


def tool_call_standalone(
    *, user: AbstractBaseUser, key: ApiKey | None, toolset: str, tool: str, arguments: Any, job_call_id: str = ""
) -> ToolCall:
    """Run one call outside any sandbox (POST /api/v1/tools/execute) and return its finished record.

    With a user key it is a ``standalone`` call. With a job-scoped key and the job's call_id, it is
    a ``ptc`` call of that job, held to the job's toolsets. A tool that fails still returns its
    record (``failed``); a request that names no such toolset or tool raises ApplicationError.
    """
    job = None
    if key is not None and key.exec_job_id is not None:
        job = ExecJob.objects.select_related("user").get(pk=key.exec_job_id)
        if job_call_id != job.call_id:
            raise ApplicationError(
                "call_id_mismatch", "x-ptc-call-id must be the call_id of the job this key belongs to.", status=403
            )
        if toolset not in job.toolsets:
            raise ApplicationError(
                "toolset_not_granted", f"Toolset '{toolset}' was not granted to job {job.call_id}.", status=403
            )
    found_toolsets, _ = toolsets_resolve(user=user, keys=[toolset])
    policy = policy_get()
    checker = CallChecker(
        user=user, toolsets=found_toolsets, direct_only=frozenset(policy.direct_only_tools), ptc_only=job is not None
    )
    call_id = f"ptc_{uuid.uuid4().hex}" if job else f"standalone_{uuid.uuid4().hex}"
    record = {"call_id": call_id, "user": user, "job": job, "toolset": toolset, "tool": tool, "arguments": arguments}
    try:
        found = checker.check(toolset, tool, arguments)
    except ToolFailure as failure:
        if failure.code in ("unknown_toolset", "unknown_tool"):
            raise ApplicationError(failure.code, f"{failure.message[:1].upper()}{failure.message[1:]}.") from None
        if failure.code == "tool_not_ptc":
            raise ApplicationError(failure.code, f"{failure.message[:1].upper()}{failure.message[1:]}.", status=403) from None
        return _tool_call_record(**record, found=None, error=failure.as_dict())
    channel = channels.job_channel(job.call_id) if job else channels.call_channel(call_id)
    with channels.subscribe(channel) as subscription:  # before the enqueue: the result can't be missed
        _tool_call_record(**record, found=found)
        refused = _tool_call_reserve(call_id=call_id, user=user, tool=found, job=job)
        if refused is None and _tool_call_enqueue(call_id=call_id) is None:
            deadline = time.monotonic() + (found.timeout or settings.PTC_DEFAULT_TOOL_TIMEOUT) + CALL_GRACE_SECONDS
            while not any(m.get("call_id") == call_id for m in subscription.drain()):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    _tool_call_finish(call_id=call_id, error={"code": "tool_timeout", "message": CALL_TIMEOUT_MESSAGE})
                    break
                connection.close()  # not held while the tool runs: the pool is for requests that query
                subscription.wait(remaining)
    return ToolCall.objects.get(call_id=call_id)


CALL_TIMEOUT_MESSAGE = "no result arrived in time: the tools workers may be down or overloaded"


def _reply(call: ToolCall) -> dict[str, Any]:
    if call.status == ToolCall.Status.COMPLETED:
        return {"ok": True, "result": call.output}
    return {"ok": False, "error": call.error or {"code": "tool_error", "message": "the call failed"}}


def _tool_call_finish(
    *,
    call_id: str,
    output: Any = None,
    error: dict[str, str] | None = None,
    billed: bool = True,
    event: bool = True,
    record: ToolCall | None = None,
) -> bool:
    """Move an executing call to completed or failed, settling or releasing its credits in the same
    transaction, and publish its event (unless ``event=False``: the caller does, later). Return
    False if it had already finished (a redelivery: nothing changes). ``billed=False`` says the tool
    is never billed, which skips the books. ``record``, the call's row, is brought up to date."""
    fields: dict[str, Any] = {
        "status": ToolCall.Status.FAILED if error else ToolCall.Status.COMPLETED,
        "output": None if error else storable(output),
        "error": storable(error),
        "finished_at": timezone.now(),
    }
    credits = 0
    if billed and not error and connection.vendor == "postgresql":
        charged = call_complete_and_settle(tool_call_id=call_id, output=fields["output"], finished_at=fields["finished_at"])
        finished, credits = charged is not None, charged or 0
    else:
        if billed and not error:
            # What it costs is what was held for it: recorded in the same UPDATE, settled right after.
            held = Reservation.objects.filter(tool_call_id=OuterRef("call_id"), status=Reservation.Status.HELD)
            fields["credits"] = Coalesce(Subquery(held.values("amount")[:1]), 0)
        with transaction.atomic() if billed and not error else nullcontext():
            finished = bool(ToolCall.objects.filter(call_id=call_id, status=ToolCall.Status.EXECUTING).update(**fields))
            if finished and billed and not error:
                credits = credits_settle(tool_call_id=call_id)
        if finished and billed and error:
            credits_release(tool_call_id=call_id)
    if finished and record is not None:
        for name, value in {**fields, "credits": credits}.items():
            setattr(record, name, value)
    if finished and event:
        _tool_call_event(record if record is not None else ToolCall.objects.get(call_id=call_id))
    return finished


def _tool_call_reserve(
    *, call_id: str, user: AbstractBaseUser, tool: Tool, job: ExecJob | None, quotes: dict[Any, Any] | None = None
) -> dict[str, str] | None:
    """Hold the call's price before it runs. Return the error that refused it, after failing its record.

    ``quotes`` keeps a job's prices for its life, so its calls don't price the same tool again.
    """
    if quotes is not None and tool.pk in quotes:
        quote = quotes[tool.pk]
    else:
        quote = price_quote(user=user, toolset=tool.toolset, tool=tool)
        if quotes is not None:
            quotes[tool.pk] = quote
    if quote is None:
        return None
    try:
        credits_reserve(user=user, tool_call_id=call_id, quote=quote, exec_job=job, max_credits=job.max_credits if job else None)
    except CreditsRefused as refused:
        error = {"code": refused.code, "message": refused.message}
        _tool_call_finish(call_id=call_id, error=error)
        return error
    return None


# The claim and the read of the row in one statement (PostgreSQL and SQLite both have RETURNING):
# executing, unclaimed, and its job (if any) still running.
_CLAIM_SQL = f"""
UPDATE {ToolCall._meta.db_table} SET claimed_at = %s
WHERE call_id = %s AND status = 'executing' AND claimed_at IS NULL
  AND (exec_job_id IS NULL OR exec_job_id IN (SELECT id FROM {ExecJob._meta.db_table} WHERE status = 'running'))
RETURNING *
"""  # noqa: S608 - table names from the models, values as parameters


# The calls this process is running, whose leases tool_calls_heartbeat renews.
_running_calls: set[str] = set()
_running_lock = threading.Lock()


def tool_calls_heartbeat() -> int:
    """Renew the lease of every call this tools worker is running. Return how many were renewed."""
    with _running_lock:
        running = list(_running_calls)
    if not running:
        return 0
    return ToolCall.objects.filter(call_id__in=running, status=ToolCall.Status.EXECUTING).update(heartbeat_at=timezone.now())


def tool_call_execute(*, call_id: str) -> None:
    """Run one recorded call, once: claim it, run it, record the result, push it to the job.

    The claim is one conditional UPDATE: the call must still be executing, unclaimed, and its job
    still running. A redelivered task finds the claim taken: if the call finished, its result is
    pushed again (the bridge ignores repeats); if it never finished, the worker that ran it died,
    and it fails as ``worker_lost`` rather than run twice.
    """
    claimed_rows = list(ToolCall.objects.raw(_CLAIM_SQL, [timezone.now(), call_id]))
    claimed = bool(claimed_rows)
    call = claimed_rows[0] if claimed else ToolCall.objects.filter(call_id=call_id).first()
    if call is None:
        logger.warning("tool call not found", extra={"call_id": call_id})
        return
    tool = None
    if claimed:
        tool = tool_for_call(tool_id=call.tool_id) if call.tool_id else None
        if tool is None:
            reply = _tool_call_fail(call_id, "unknown_tool", "the tool no longer exists")
        else:
            with _running_lock:
                _running_calls.add(call_id)
            try:
                reply = _tool_call_run(call=call, tool=tool)
            finally:
                with _running_lock:
                    _running_calls.discard(call_id)
    elif call.status != ToolCall.Status.EXECUTING:
        reply = _reply(call)
    elif call.claimed_at is not None:
        reply = _tool_call_fail(call_id, "worker_lost", "the tools worker running this call stopped; it was not run again")
    else:
        reply = _tool_call_fail(call_id, "job_ended", "the job ended before this call started; it was not run")
    channels.publish(_result_channel(call_id, call.ptc_call_id), {"kind": "result", "call_id": call_id, **reply})
    if claimed and tool is not None and call.ptc_call_id:  # the code has its result; now tell the watchers
        _tool_call_event(call)


def _result_channel(call_id: str, ptc_call_id: str) -> str:
    """A job's calls report on the job's channel; a standalone call on its own."""
    return channels.job_channel(ptc_call_id) if ptc_call_id else channels.call_channel(call_id)


def tool_call_abort(*, call_id: str) -> None:
    """Fail a call whose task crashed, and push that to its job, so the code gets a ToolError now."""
    reply = _tool_call_fail(call_id, "internal_error", "the tools worker failed while running this call; see its log")
    ptc_call_id = ToolCall.objects.filter(call_id=call_id).values_list("ptc_call_id", flat=True).first()
    if ptc_call_id is not None:
        channels.publish(_result_channel(call_id, ptc_call_id), {"kind": "result", "call_id": call_id, **reply})


def _tool_call_fail(call_id: str, code: str, message: str) -> dict[str, Any]:
    error = {"code": code, "message": message}
    if _tool_call_finish(call_id=call_id, error=error):
        return {"ok": False, "error": error}
    return _reply(ToolCall.objects.get(call_id=call_id))


def _tool_call_run(*, call: ToolCall, tool: Tool) -> dict[str, Any]:
    """Run the tool and record the outcome on ``call``. Return the reply for the waiting code."""
    call_id, arguments = call.call_id, call.input
    started = time.monotonic()
    # Hand the database connection back to the pool while the tool runs: a slow tool must not hold
    # one of the pool's few connections idle while other calls wait for it.
    connection.close()
    try:
        output = tool_run(
            toolset=tool.toolset, tool=tool, arguments=arguments, timeout=tool.timeout or settings.PTC_DEFAULT_TOOL_TIMEOUT
        )
        size = len(json.dumps(output, allow_nan=False))
        limit = settings.PTC_MAX_TOOL_OUTPUT_BYTES
        if size > limit:
            raise ToolFailure("output_too_large", f"the tool returned {size} bytes of JSON; the limit is {limit}")
    except ToolFailure as failure:
        reply: dict[str, Any] = {"ok": False, "error": failure.as_dict()}
    except (TypeError, ValueError) as exc:
        reply = {"ok": False, "error": {"code": "invalid_output", "message": f"the tool's output is not JSON: {exc}"}}
    else:
        reply = {"ok": True, "result": output}
    # The event goes out after the result is pushed to the waiting code (tool_call_execute).
    finished = _tool_call_finish(
        call_id=call_id,
        output=reply.get("result"),
        error=reply.get("error"),
        billed=billable(toolset=tool.toolset, tool=tool),
        event=False,
        record=call,
    )
    logger.info(
        "tool call ran",
        extra={"call_id": call_id, "tool": str(tool), "ok": reply["ok"], "ms": round((time.monotonic() - started) * 1000, 2)},
    )
    # Not finished by us means the bridge gave up on it meanwhile: the record's word is final.
    return reply if finished else _reply(ToolCall.objects.get(call_id=call_id))
