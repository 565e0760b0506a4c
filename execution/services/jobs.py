"""Writes for exec jobs: create, run (in a sandbox), finish, cancel, reap."""

import functools
import json
import logging
import math
import os
import socket
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import User
from django.db import DatabaseError, IntegrityError, InterfaceError, OperationalError, connection, transaction
from django.db.models import Case, Exists, F, OuterRef, Q, TextField, Value, When, prefetch_related_objects
from django.db.models.functions import Coalesce
from django.utils import timezone

from execution.backplane import Cancel, End, Resync, Subscription, backplane, job_channel, job_end_channel
from execution.events import (
    event_publish,
    job_end_payload,
    job_start_payload,
    job_view,
    output_events,
    output_from_stream,
    output_publish,
)
from execution.models import ExecJob, ExecSession, ToolCall, WorkFile, new_exec_call_id
from execution.sandbox.limits import Limits
from execution.sandbox.pool import sandbox_reap
from execution.sandbox.process import SDK_MB, SandboxUnavailable
from execution.sandbox.session import Outcome, Session
from execution.selectors import (
    CALLS_IN_ORDER,
    calls_overdue_at,
    container_job_calls_last,
    container_jobs_idle,
    exec_job_with_calls,
)
from execution.services.calls import (
    CALL_TIMEOUT_MESSAGE,
    JOB_ENDED_MESSAGE,
    call_job_running,
    tool_call_finish,
    tool_calls_close_held,
    tool_calls_fail_queued,
    tool_calls_reap,
)
from execution.services.quotas import container_quota_check, exec_quota_check
from execution.services.router import JobCallRouter
from execution.services.sessions import (
    LiveSession,
    exec_session_job_ended,
    exec_session_take,
    exec_sessions_reap,
    job_files_done,
    job_inputs,
    session_ended_before_start,
    session_files_put,
    session_guest_limits,
    session_job_done,
    session_job_inputs,
    session_limits,
    session_sandbox_release,
    session_sandbox_take,
)
from ptcproject import queues, rows, tracing
from ptcproject.accounts.services import api_key_create, job_keys_revoke
from ptcproject.broker import broker_trouble
from ptcproject.celery import task_publish
from ptcproject.db import LockedRows, db_reset, db_retry, statement_cancelled, unless_locked
from ptcproject.errors import ApplicationError, call_error, job_error
from ptcproject.metrics import job_finished_observe
from ptcproject.policy.models import Policy
from ptcproject.policy.selectors import policy_get, policy_read, ptc_decision, quotas_of, quotas_read
from ptcproject.storage import MAX_JSON_DEPTH, json_depth_exceeds, storable
from tools.client import CLIENT_KEY, client_tools_clean, client_toolset
from tools.sdk import sdk_cached, sdk_job_files
from tools.selectors import toolset_keys_admitted, toolset_keys_known, toolset_keys_read, toolsets_resolve

logger = logging.getLogger("ptc.execution")
Status = ExecJob.Status
# The header of a job's message that names its call_id: its worker subscribes to its channel first.
CALL_ID_HEADER = "ptc_call_id"
# A job's end pushes the job with it to its waiters up to this size; above it, they read the record.
END_PUSH_MAX_BYTES = 256 << 10


def job_limits(*, policy: Policy, timeout: float, parallel_cap: int = 0) -> Limits:
    """Return the limits a new job runs under: the policy's, one call at a time if it is sequential,
    and no more parallel calls than ``parallel_cap`` (the user's tool-call quota; 0: none)."""
    parallel = 1 if policy.sequential else policy.max_parallel_tool_calls
    return Limits(
        timeout=timeout,
        memory_mb=policy.memory_limit_mb,
        max_output_bytes=policy.max_output_bytes,
        max_tool_calls=policy.max_tool_calls,
        max_parallel_tool_calls=min(parallel, parallel_cap) if parallel_cap else parallel,
        max_processes=settings.PTC_MAX_PROCESSES,
        max_file_mb=settings.PTC_MAX_FILE_MB,
        max_open_files=settings.PTC_MAX_OPEN_FILES,
        max_client_wait=policy.max_client_wait,
    )


# -- Jobs ----------------------------------------------------------------------------------------
def exec_job_create(
    *,
    user: User,
    code: str,
    toolsets: list[str] | None,
    timeout: float | None,
    title: str = "",
    max_credits: int | None = None,
    client_tools: list[dict[str, Any]] | None = None,
    session: ExecSession | None = None,
    files: dict[str, bytes] | None = None,
    call_id: str = "",
    before_enqueue: Callable[[], None] | None = None,
) -> ExecJob:
    """Check the request against the policy, record the job as ``queued``, and enqueue it once committed.

    ``client_tools`` are tools the caller runs itself (``ptc_tools.client.Client``; tools/client.py).
    In a ``session``, the job runs in the session's sandbox, with its toolsets and limits (and its
    own timeout); ``files`` are written under /work before the code runs. ``call_id`` is the one
    it takes, if given (its waiter subscribed to its end first), and ``before_enqueue`` is called
    once the job is committed, before it is queued (the waiter's subscription is confirmed then).

    Raise ApplicationError: ``code_too_large`` (413), ``validation_error`` for a timeout above the
    policy's maximum (400; never clamped) or bad client tools, ``unknown_toolset`` (400),
    ``ptc_disabled`` (403), ``rate_limited`` (429: past a tenant quota), ``broker_unavailable`` (503,
    and the job is not created); with a session, 410 ``session_expired`` or ``session_lost``, 409
    ``session_busy``.
    """
    size = len(code.encode())
    if size > settings.PTC_MAX_CODE_BYTES:
        raise ApplicationError(
            "code_too_large",
            f"The code is {size} bytes; the limit is {settings.PTC_MAX_CODE_BYTES}. Send less code.",
            status=413,
            details={"size": size, "limit": settings.PTC_MAX_CODE_BYTES},
        )
    # The policy, the toolsets and the quotas in one round trip: none needs another's result. A
    # session's toolsets are its own (its sandbox has their modules already): none is read.
    policy, visible, own = rows.together(
        policy_read(),
        toolset_keys_read(user=user, keys=[] if session is not None else toolsets),
        quotas_read(user=user),
    )
    if timeout is None:
        timeout = policy.default_timeout
    if not timeout >= ExecJob.MIN_TIMEOUT:  # NaN too: every caller's serializer checks it; this holds for any other
        raise ApplicationError(
            "validation_error",
            f"timeout {timeout:g} s is below the least a job may have, {ExecJob.MIN_TIMEOUT:g} s.",
            details={"timeout": [f"Ensure this value is greater than or equal to {ExecJob.MIN_TIMEOUT:g}."]},
        )
    if timeout > policy.max_timeout:
        raise ApplicationError(
            "validation_error",
            f"timeout {timeout:g} s is above the maximum of {policy.max_timeout} s.",
            details={"timeout": [f"Ensure this value is less than or equal to {policy.max_timeout}."]},
        )
    if session is not None:
        keys = list(session.toolsets)
    elif toolsets is None:
        # Every toolset the user may use with PTC: the policy's lists narrow what they can see.
        keys = toolset_keys_admitted(visible=visible, allowlist=policy.toolset_allowlist, blocklist=policy.toolset_blocklist)
    else:
        keys = toolset_keys_known(keys=toolsets, visible=visible)  # unknown_toolset (400) if any is not
    client = client_tools_clean(client_tools or [])
    if client and CLIENT_KEY in keys:
        raise ApplicationError(
            "validation_error",
            f"A job with client_tools has its own '{CLIENT_KEY}' module; leave the toolset '{CLIENT_KEY}' out of toolsets.",
            details={"toolsets": [f"'{CLIENT_KEY}' is the module of this job's client_tools"]},
        )
    decision = ptc_decision(policy=policy, user=user, toolsets=keys, title=title)
    if not decision.enabled:
        raise ApplicationError(
            "ptc_disabled", f"PTC is disabled here: {decision.reason}.", status=403, details={"reason": decision.reason}
        )
    quotas = quotas_of(policy=policy, own=own)
    limits = job_limits(policy=policy, timeout=timeout, parallel_cap=quotas.parallel_cap())
    if session is not None:
        limits = session_limits(session=session, job=limits)
    # One INSERT on its own needs no transaction (BEGIN and COMMIT were two more round trips on
    # every job); the quota check's lock, the input files and the session's claim go with the job
    # or not at all. Either way the job is committed before it is enqueued.
    alone = not (quotas.any or files or session is not None)
    with nullcontext() if alone else transaction.atomic():
        exec_quota_check(user=user, quotas=quotas, session=session)  # rate_limited (429); locks the user's row till commit
        job = ExecJob.objects.create(
            user=user,
            code=code,
            toolsets=keys,
            title=title,
            timeout_seconds=timeout,
            limits=limits.as_dict(),
            sequential=policy.sequential,
            max_credits=max_credits,
            client_tools=client,
            session=session,
            **({"call_id": call_id} if call_id else {}),
        )
        # A session's later jobs go to the worker holding its sandbox; its first, to any.
        node = exec_session_take(session_id=session.pk, job=job).worker if session is not None else ""
        if session is not None:  # the session's files then: listed and kept as its uploads are, and sent as they are
            session_files_put(session=session, files=files or {})
        else:
            for path, content in (files or {}).items():
                WorkFile.objects.create(exec_job=job, kind=WorkFile.Kind.INPUT, path=path, content=content, size=len(content))
        transaction.on_commit(lambda: _exec_job_enqueue(job=job, node=node, before=before_enqueue))
    logger.info("job queued", extra={"job_id": str(job.id)})
    return job


def exec_job_for_container(*, user: User, container_id: str) -> ExecJob:
    """Return ``user``'s job for a managed container (a provider's own code-execution container
    whose calls come through POST /tools/execute), created ``running`` on its first call: one per
    user and ``container_id`` (a unique constraint settles a race), at most
    PTC_MAX_CONTAINERS_PER_USER open. It runs no code here; cancelling it refuses its later calls,
    and the reaper closes it once idle (``container_jobs_close_idle``).

    Call it in the transaction that records the call: the job's row stays locked until then, so
    the reaper never closes a job under a call being recorded (it reads the job's calls once it
    holds that lock itself). The call's record sets the job's ``last_call_at`` (_job_bytes_take).

    Raise ApplicationError ``job_finished`` (409) if that job has ended (cancelled, or closed
    idle), ``rate_limited`` (429) if it is new and the user has the most open.
    """
    # Read locked at once: its status then is the one the reaper's close, or a cancel, left.
    jobs = ExecJob.objects.select_for_update().filter(user=user, container_id=container_id)
    job = jobs.first()
    if job is None:
        now = timezone.now()
        try:
            with transaction.atomic():
                container_quota_check(user=user, container_id=container_id)
                job = ExecJob.objects.create(
                    user=user,
                    container_id=container_id,
                    status=Status.RUNNING,
                    code="",
                    title=f"managed container {container_id}"[:500],
                    timeout_seconds=0,
                    started_at=now,
                    heartbeat_at=now,
                    last_call_at=now,
                    worker="managed container",
                )
        except IntegrityError:  # another call of the same container created it first
            job = jobs.get()
        else:
            # Announced once made for good: the caller may make it in a transaction it then rolls
            # back (its call refused as it is recorded).
            made = job
            transaction.on_commit(
                lambda: event_publish(job_call_id=made.call_id, event="exec_start", data=job_start_payload(made))
            )
            logger.info("managed container job created", extra={"job_id": str(job.pk)})
    if job.status != Status.RUNNING:
        raise ApplicationError(
            "job_finished",
            f"The job of container {container_id} has ended ('{job.status}'); its container takes no more calls.",
            status=409,
        )
    return job


def _exec_job_enqueue(*, job: ExecJob, node: str = "", before: Callable[[], None] | None = None) -> None:
    """Send a committed job to the exec queue, or to worker ``node``'s direct queue (a session's
    sandbox is there), after calling ``before``. If the broker can't take it, the job is withdrawn
    and ApplicationError ``broker_unavailable`` (503) raised: a client is never told a job failed
    while it waits queued for ever."""
    from celery.utils.nodenames import worker_direct

    from execution.tasks import run_exec

    if before is not None:
        before()

    try:
        with run_exec.app.producer_or_acquire() as producer:
            queue = worker_direct(node).name if node else queues.EXEC
            task_publish(run_exec, producer, (str(job.pk),), queue=queue, headers={CALL_ID_HEADER: job.call_id})
    except Exception as exc:  # the broker is unreachable even after Celery's own retries
        logger.warning("could not enqueue a job; withdrawn", extra={"job_id": str(job.pk)}, exc_info=True)
        withdrawn, _ = ExecJob.objects.filter(pk=job.pk, status=Status.QUEUED).delete()
        if withdrawn:
            raise ApplicationError(
                "broker_unavailable",
                f"The job could not be queued: the message broker {broker_trouble(exc)}. Nothing was run; try again.",
                status=503,
            ) from exc
        # It was taken after all: the message went out before the error.


def exec_job_run(*, job_id: str, worker: str, node: str = "", call_id: str = "") -> None:
    """Run a queued job in a sandbox to its end. A redelivered job that was running fails as WorkerLost.

    ``call_id`` is the job's (its message's ``CALL_ID_HEADER``; one queued by an older web has
    none, and it is read). Only the reads and writes of the job before its claim, and the claim, may raise (a
    database error: the task retries it). Whatever happens after the claim, the job's end is recorded.
    """
    if not call_id:
        logger.info("the job's message does not name its call_id (an older web sent it): read", extra={"job_id": job_id})
        call_id = ExecJob.objects.filter(pk=job_id).values_list("call_id", flat=True).first() or ""
        if not call_id:
            return  # no such job (deleted): nothing to run
    try:
        # Subscribed before the claim, and confirmed while the job is claimed: a cancel can only be
        # published once the claim is committed, after Redis was sent the SUBSCRIBE on its one
        # connection. Should Redis still see the two out of order, the job's first heartbeat finds
        # it cancelled.
        channel: Subscription | Exception = backplane().subscribe_direct(job_channel(call_id))
    except Exception as exc:  # the job is still claimed, and ends saying why
        channel = exc
    with channel if isinstance(channel, Subscription) else nullcontext():
        try:
            job, policy = _exec_job_claim(job_id=job_id, worker=worker)
        except (OperationalError, InterfaceError):
            if _exec_job_unclaimable(job_id=job_id):
                return
            raise  # retried by the task
        if job is None:
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
            if isinstance(channel, Exception):
                raise RuntimeError(f"its channel is unreachable: {channel}")
            channel.confirm()
            outcome = _exec_job_sandbox(job=job, node=node, channel=channel, policy=policy)
        except Exception as exc:  # the job must end, never stay running
            logger.exception("the job's run failed", extra={"job_id": job_id})
            error = job_error("InternalError", f"the worker failed while running the job: {exc}")
            outcome = Outcome(status="failed", error=error, key_made=True)  # whether it made one is not known: revoke
    try:
        exec_job_finish(job_id=job_id, call_id=call_id, outcome=outcome, user=job.user, sdk_hash=job.sdk_hash)
    finally:
        _spent_reap(outcome)


def _exec_job_unclaimable(*, job_id: str) -> bool:
    """After a failed claim of a job: whether it has been queued past PTC_QUEUED_MAX_SECONDS, and its
    claim is not to be tried again. It is then failed ``WorkerLost`` here, as the reaper fails a job
    lost in the queue, or, its row held locked still, left to the reaper, which does so once the
    lock goes. A claim cancelled at each try (its row held locked past PTC_DB_STATEMENT_TIMEOUT)
    took a timeout and a backoff a try, and run_exec's retries went on for hours past the bound,
    the job queued all along. Raises what reading the job raises (the database away: the task retries)."""
    db_reset()  # the claim's connection may be the broken one
    created = ExecJob.objects.filter(pk=job_id, status=Status.QUEUED).values_list("created_at", flat=True).first()
    bound = settings.PTC_QUEUED_MAX_SECONDS
    if created is None or created > timezone.now() - timedelta(seconds=bound):
        return False
    fail = functools.partial(
        _exec_job_fail_if,
        job_id=job_id,
        status=Status.QUEUED,
        kind="WorkerLost",
        message=f"no exec worker could claim the job within {bound} s (PTC_QUEUED_MAX_SECONDS): its record was held "
        "locked, or the database could not be reached; it was not run",
    )
    failed = unless_locked(fail, what="failing a job its worker could not claim", job_id=job_id)
    then = "left to the reaper (its row held locked)" if failed is None else "failed WorkerLost"
    logger.warning("a claim failed past PTC_QUEUED_MAX_SECONDS is not retried: the job is %s", then, extra={"job_id": job_id})
    return True


def _spent_reap(outcome: Outcome) -> None:
    """Kill the sandbox that gave the job its result (``outcome.spent``) and reap it off this path,
    if that is not done yet."""
    spent, outcome.spent = outcome.spent, None
    if spent is not None:
        sandbox_reap(spent)


@functools.cache
def _claim_sql() -> str:
    users = get_user_model()
    return f"""
    WITH claimed AS (
        UPDATE {rows.table(ExecJob)} SET status = %(running)s, started_at = %(now)s, heartbeat_at = %(now)s, worker = %(worker)s
        WHERE id = %(id)s AND status = %(queued)s
        RETURNING *
    )
    SELECT {rows.columns(ExecJob, "j")}, {rows.columns(users, "u")}, {rows.columns(ExecSession, "s")},
           EXISTS (SELECT 1 FROM {rows.table(WorkFile)} f WHERE f.exec_job_id = j.id AND f.kind = %(input)s)
    FROM claimed j JOIN {rows.table(users)} u ON u.id = j.user_id LEFT JOIN {rows.table(ExecSession)} s ON s.id = j.session_id
    """  # noqa: S608 - names from the models, values as parameters


def _exec_job_claim(*, job_id: str, worker: str) -> tuple[ExecJob | None, Policy]:
    """Claim a queued job for this worker with one conditional UPDATE. Return it as claimed, with
    its user, its session and ``has_inputs`` (whether it brought files), or None if it was not
    queued (a duplicate delivery, or cancelled meanwhile); and the policy, read with it, that the
    job is prepared by.

    On PostgreSQL the claim returns the job in the same statement (a data-modifying CTE), and the
    policy is read in the same round trip (``rows.together``): one round trip, and no queryset to
    compile, for what took three (the claim, the job's read, the policy). The claim is committed with the
    policy's read: should that fail, the job is not claimed, and its task retries."""
    now = timezone.now()
    if connection.vendor != "postgresql":
        claimed = ExecJob.objects.filter(pk=job_id, status=Status.QUEUED).update(
            status=Status.RUNNING, started_at=now, heartbeat_at=now, worker=worker
        )
        if not claimed:
            return None, policy_get()
        inputs = WorkFile.objects.filter(exec_job=OuterRef("pk"), kind=WorkFile.Kind.INPUT)
        job = ExecJob.objects.select_related("user", "session").annotate(has_inputs=Exists(inputs)).get(pk=job_id)
        return job, policy_get()
    params: dict[str, Any] = {
        "id": job_id,
        "now": now,
        "worker": worker,
        "running": Status.RUNNING,
        "queued": Status.QUEUED,
        "input": WorkFile.Kind.INPUT,
    }
    return rows.together(rows.Statement(_claim_sql(), params, _claimed), policy_read())


def _claimed(found: list[tuple[Any, ...]]) -> ExecJob | None:
    """The job of the claim's row (``_claim_sql``), with its user, its session and ``has_inputs``;
    None without one."""
    if not found:
        return None
    row = found[0]
    job = rows.from_row(ExecJob, row)
    at = len(ExecJob._meta.concrete_fields)
    job.user = rows.from_row(get_user_model(), row, start=at)
    at += len(get_user_model()._meta.concrete_fields)
    job.session = rows.from_row(ExecSession, row, start=at) if row[at] is not None else None
    job.has_inputs = row[-1]  # type: ignore[attr-defined]  # as the annotation names it
    return job


def _exec_job_sandbox(*, job: ExecJob, node: str, channel: Subscription, policy: Policy) -> Outcome:
    """Run a claimed job's code in a sandbox (its session's, held by this worker, ``node``) and
    return what happened. ``channel``: the job's, subscribed before the claim; a cancel that
    landed since is in it, and ends the job before its code is sent. ``policy``: read with the claim."""
    job_id = str(job.pk)
    # Nothing has run yet: a database that drops meanwhile (a restart) is waited for, not the job's end.
    prepared = db_retry(lambda: _exec_job_prepare(job=job, policy=policy), what="preparing a job", job_id=job_id)
    if isinstance(prepared, Outcome):
        return prepared
    job, router, sdk_files = prepared
    limits = Limits.from_dict(job.limits)
    # Its log expires even if its end never reaches it (this worker killed as the end was stored,
    # Redis away at that moment: a reader appends it from the records, but a log no one read stayed
    # for good). Well past the longest the job can take: its clock, its waits on the client, calls
    # still running at its end (a ceiling's worth), its lease and its end's retries; then the
    # retention. Its end, appended, sets the retention.
    lifetime = limits.timeout + limits.max_client_wait + settings.PTC_TIMEOUT_CEILING
    lifetime += settings.PTC_JOB_LEASE_SECONDS + settings.PTC_DB_RETRY_SECONDS + settings.PTC_EVENTS_RETENTION_SECONDS
    event_publish(job_call_id=job.call_id, event="exec_start", data=job_start_payload(job), expire=math.ceil(lifetime))
    # Cancelled since its claim: no sandbox is taken for it (a session's would be lost with it).
    # After a reconnect, a cancel pushed meanwhile is lost: the record says.
    for message in channel.drain():
        if isinstance(message, Cancel) or (isinstance(message, Resync) and not _exec_job_heartbeat(job_id=job.pk)):
            return Outcome(status="cancelled")
    # Every job may bring files and gets back the files its code wrote (within the quota).
    extra: dict[str, Any] = {
        "files": job_inputs(job_id=job.pk) if job.has_inputs else {},  # type: ignore[attr-defined]  # set by the claim
        "collect_files": {"max_bytes": settings.PTC_FILES_MAX_BYTES, "max_count": settings.PTC_FILES_MAX_COUNT},
    }
    live: LiveSession | None = None
    sent: list[tuple[int, datetime]] = []
    session: Session | None = None
    if job.session is not None:
        taken = session_sandbox_take(session=job.session, node=node)
        if isinstance(taken, Outcome):
            return taken
        live = taken
    try:
        if live is not None and job.session is not None:
            session_id = job.session.pk
            # Nothing has reached the sandbox yet: a database that drops meanwhile is waited for.
            uploads, sent = db_retry(
                lambda: session_job_inputs(session_id=session_id), what="reading a session's files", job_id=job_id
            )
            extra.update(session=True, limits=session_guest_limits(session=job.session))
            extra["files"] = {**uploads, **extra["files"]}
        session = Session(
            code=job.code,
            limits=limits,
            sdk_files=sdk_files,
            sdk_new=live is None or live.sdk_hash != job.sdk_hash,  # a session's sandbox has it from an earlier job
            router=router,
            channel=channel,
            heartbeat=lambda: _exec_job_heartbeat(job_id=job.pk),
            heartbeat_every=settings.PTC_JOB_HEARTBEAT_SECONDS,
            max_frame=settings.PTC_MAX_FRAME_BYTES,
            max_buffered=settings.PTC_MAX_BUFFERED_BYTES,
            job_info={"call_id": job.call_id},
            make_key=lambda: _exec_job_key(job=job),
            on_output=lambda stream, text: output_publish(job_call_id=job.call_id, output=[(stream, text)]),
            sandbox=live.sandbox if live is not None else None,
            keep=live is not None,
            extra=extra,
            max_files_bytes=settings.PTC_FILES_MAX_BYTES,
            max_tool_bytes=settings.PTC_MAX_JOB_TOOL_BYTES,
        )
        try:
            outcome = session.run()
        except SandboxUnavailable as exc:
            logger.error("this host cannot run sandboxes: %s", exc, extra={"job_id": job_id})
            outcome = Outcome(status="failed", error=job_error("SandboxCrashed", str(exc)), key_made=session.key_asked)
        except Exception as exc:  # the worker survives anything a sandbox does; the job records it
            logger.exception("sandbox failed", extra={"job_id": job_id})
            outcome = Outcome(status="failed", error=job_error("SandboxCrashed", str(exc)), key_made=session.key_asked)
        outcome.tail = session.tail  # whatever ended it: what the code printed last goes with its end
    finally:
        if live is not None and job.session is not None:
            # A sandbox that nothing of this job reached (cancelled as it started, or its inputs
            # unreadable) is still the session's, as it was: its SDK, and its uploads still to send.
            reached = session is not None and session.sent_any
            kept = session.kept if session is not None else live.sandbox.proc.poll() is None
            sdk_hash = job.sdk_hash if reached else live.sdk_hash
            _exec_job_session_release(job=job, live=live, kept=kept, sdk_hash=sdk_hash)
            sent = sent if reached else []
    if live is not None and live.ended and outcome.status != "cancelled":
        outcome.status = "failed"
        outcome.error = job_error("SessionEnded", f"the session ended while the job ran: {live.ended}")
    if outcome.error and outcome.error.get("type") == "InputFiles":
        sent = []  # the session's uploads did not all reach /work: they go again with the next job
    _exec_job_files_done(job=job, outcome=outcome, sent=sent)
    assert job.started_at is not None, "the job was loaded after exec_job_run's claim set started_at"
    outcome.timings["queue_ms"] = round((job.started_at - job.created_at).total_seconds() * 1000, 2)
    return outcome


def _exec_job_session_release(*, job: ExecJob, live: LiveSession, kept: bool, sdk_hash: str) -> None:
    """Hand a session's sandbox back after its job (session_sandbox_release). A failure here loses
    the session, not the job: what the code did and printed is still recorded as its end. A
    session whose end could not be stored is ended ``lost`` by its lapsed lease."""
    assert job.session_id is not None
    try:
        db_retry(
            lambda: session_sandbox_release(session_id=job.session_id, live=live, kept=kept, sdk_hash=sdk_hash),
            what="handing a session's sandbox back",
            job_id=str(job.pk),
        )
    except Exception:
        logger.exception("could not hand a session's sandbox back", extra={"job_id": str(job.pk)})


def _exec_job_files_done(*, job: ExecJob, outcome: Outcome, sent: list[tuple[int, datetime]]) -> None:
    """Store the files the job's code wrote (the session's, or the job's outputs) before the job's
    end is recorded: whoever sees it ended sees its files. A failure here loses the files, not the job."""
    try:
        if job.session is not None:
            db_retry(
                lambda: session_job_done(job_id=job.pk, session_id=job.session_id, outcome=outcome, files_sent=sent),
                what="storing a session job's files",
                job_id=str(job.pk),
            )
        elif outcome.files or outcome.files_omitted:
            db_retry(lambda: job_files_done(job_id=job.pk, outcome=outcome), what="storing a job's files", job_id=str(job.pk))
    except Exception:
        logger.exception("could not store a job's files", extra={"job_id": str(job.pk)})


def _exec_job_prepare(*, job: ExecJob, policy: Policy) -> "tuple[ExecJob, JobCallRouter, dict[str, str]] | Outcome":
    """Build a claimed job's SDK and its call router, by ``policy`` (read with its claim). Return
    those, or the Outcome that ends the job if its SDK can't be built. Safe to run again."""
    job_id = str(job.pk)
    direct_only = frozenset(policy.direct_only_tools)
    toolsets, _ = toolsets_resolve(user=job.user, keys=job.toolsets)
    extra = [client_toolset(job.client_tools)] if job.client_tools else []
    try:
        sdk = sdk_cached(toolsets=toolsets, extra=extra, direct_only=direct_only)
    except (OperationalError, InterfaceError):
        raise
    except Exception as exc:  # said in the job's error
        logger.exception("sdk generation failed", extra={"job_id": job_id})
        return Outcome(status="failed", error=job_error("SandboxCrashed", f"the SDK could not be generated: {exc}"))
    files = sdk_job_files(sdk)
    size = sum(len(content.encode()) for content in files.values())
    if size > SDK_MB << 20:
        message = f"the SDK of the job's toolsets is {size} bytes; a sandbox takes at most {SDK_MB} MiB: grant fewer toolsets"
        return Outcome(status="failed", error=job_error("ResourceLimit", message))
    job.sdk_hash = sdk.hash  # recorded with the job's end (exec_job_finish)
    router = JobCallRouter(job=job, toolsets=toolsets, direct_only=direct_only, extra=extra, policy=policy)
    return job, router, files


def _exec_job_key(*, job: ExecJob) -> str:
    """Make the job's key, what a sandbox on another host would call back with (POST
    /api/v1/tools/execute), and return it; it dies with the job. Made when the job's code first
    asks for it (``ptc_tools._runtime.job_info["key"]``): most jobs never do."""
    _, key = api_key_create(
        user=job.user,
        name=f"job {job.call_id}",
        exec_job=job,
        # Time spent waiting on the client does not count against the timeout, up to max_client_wait.
        expires_at=timezone.now() + timedelta(seconds=job.timeout_seconds + Limits.from_dict(job.limits).max_client_wait + 60),
    )
    return key


def _exec_job_heartbeat(*, job_id: Any) -> bool:
    """Renew a running job's lease. Return False if the job is no longer running (cancelled, or
    reaped while its worker stalled): its sandbox must stop. A database outage is not the job's end:
    the lease outlasts a short one, so this says go on; nor is its row held locked (the renewal
    cancelled at PTC_DB_STATEMENT_TIMEOUT), which the log line says, not an outage."""
    try:
        return bool(ExecJob.objects.filter(pk=job_id, status=Status.RUNNING).update(heartbeat_at=timezone.now()))
    except (OperationalError, InterfaceError) as exc:
        why = (
            "its row is held locked (the statement was cancelled)" if statement_cancelled(exc) else "the database is unreachable"
        )
        logger.warning("could not renew the job's lease: %s", why, extra={"job_id": str(job_id)})
        db_reset()
        return True


def exec_job_finish(*, job_id: Any, call_id: str, outcome: Outcome, user: User | None = None, sdk_hash: str = "") -> None:
    """Record the outcome of a running job, close it and announce its end, with the output its
    events had not carried yet (``outcome.tail``). A cancelled job stays cancelled, with what the
    code printed and the ``sdk_hash`` of the SDK it ran with (if it got that far). ``user``: the
    job's, if the caller has it at hand.

    While the database is unreachable it retries (PTC_DB_RETRY_SECONDS); a value it cannot store
    ends the job failed with a short error. If the database stays away longer, the job's lease
    lapses and the reaper ends it once it is back: it never stays running.
    """
    if json_depth_exceeds(outcome.return_value):  # the sandbox's runner checks too; this is the guard
        outcome.status, outcome.return_value = "failed", None
        outcome.error = job_error("ResourceLimit", f"the return value nests deeper than {MAX_JSON_DEPTH} levels")
    now = timezone.now()
    sdk = {"sdk_hash": sdk_hash} if sdk_hash else {}
    output = {
        "stdout": storable(outcome.stdout),
        "stderr": storable(outcome.stderr),
        "stdout_truncated": outcome.stdout_truncated,
        "stderr_truncated": outcome.stderr_truncated,
        "timings": outcome.timings,
        **sdk,
    }
    result = {"status": outcome.status, "return_value": storable(outcome.return_value), "error": storable(outcome.error)}
    calls = outcome.timings.get("tool_calls")
    # A job that made no call (from its sandbox or with its key) is closed as its end is stored:
    # its close has nothing to wait for. Any other is closed by its close, which claims closed_at
    # once its running calls have ended: this worker killed while it waits for them, the reaper
    # closes the job and announces its end (_exec_jobs_close_left).
    closed = {"closed_at": now} if calls == 0 and not outcome.key_made else {}

    def store() -> ExecJob | None:
        # No transaction: each UPDATE is whole on its own, and the second only runs when the first
        # found the job no longer running (BEGIN and COMMIT were two round trips on every job's end).
        # Each returns the job as stored (None: not in that status), so its close need not read it.
        try:
            ended = {"finished_at": now, **closed, **result, **output}
            stored = rows.update_returning(ExecJob, pk=job_id, status=Status.RUNNING, values=ended)
            if stored is None:
                # Cancelled while it ran: keep that status, but keep what the code printed too. Not
                # closed yet: its close may wait for its running calls, and if this worker dies
                # meanwhile, the reaper closes it (_exec_jobs_close_left); its close claims it.
                stored = rows.update_returning(ExecJob, pk=job_id, status=Status.CANCELLED, values=output)
        except (OperationalError, InterfaceError):
            raise
        except DatabaseError:  # the value itself can't be stored: the job still ends, and says why
            logger.exception("could not store a job's outcome", extra={"job_id": str(job_id)})
            error = job_error("InternalError", "the job's output could not be stored")
            values = {"status": Status.FAILED, "error": error, "finished_at": now, **closed, **sdk}
            stored = rows.update_returning(ExecJob, pk=job_id, status=Status.RUNNING, values=values)
        if stored is not None and user is not None:
            stored.user = user
        return stored

    # The job's sandbox waits for its end to be out (outcome.spent), not for a database that is away:
    # what its threads do meanwhile is no longer read, and its memory is held.
    sandbox_gone = functools.partial(_spent_reap, outcome)
    try:
        stored = db_retry(store, what="storing a job's outcome", job_id=job_id, on_wait=sandbox_gone)
        job = db_retry(
            lambda: _exec_job_close(
                job_id=job_id,
                job=stored,
                bridge_calls=None if calls is None else int(calls),
                key_made=outcome.key_made,
                tail=outcome.tail,
                await_running=True,
                before_wait=sandbox_gone,  # nothing of the sandbox is read while its calls are waited for
            ),
            what="closing a job",
            job_id=job_id,
            on_wait=sandbox_gone,
        )
    except DatabaseError:
        logger.exception("could not record a job's end; the reaper will", extra={"job_id": str(job_id)})
        # What the code printed last goes out now: the reaper stores the output the events carried.
        output_publish(job_call_id=call_id, output=outcome.tail)
        return
    sandbox_gone()  # its end is out
    logger.info("job finished", extra={"job_id": str(job_id), "status": job.status, **outcome.timings})
    job_finished_observe(
        status=job.status, toolsets=job.toolsets, seconds=job.execution_time_seconds, spawn_ms=outcome.timings.get("spawn_ms")
    )
    tracing.job_trace_export(job=job)


def _exec_job_close(
    *,
    job_id: Any,
    job: ExecJob | None = None,
    bridge_calls: int | None = None,
    key_made: bool = True,
    tail: Sequence[tuple[str, str]] = (),
    await_running: bool = False,
    before_wait: Callable[[], None] | None = None,
) -> ExecJob:
    """What follows every job's end, however it ended: its job key is revoked, its calls still
    queued fail as never run (a tools worker that claimed one finishes it), and its end is
    announced. Idempotent. Return the job.

    ``job`` is the job as its end was just stored, if the caller has it (else it is read),
    ``bridge_calls`` how many calls its sandbox made, if known, ``key_made`` False when its
    worker knows its code never asked for its key (so none was made, or used), and ``tail`` the
    output its events had not carried yet, ``(stream, text)``: they go out before its end.

    With ``await_running``, the calls a tools worker was running when the job ended are waited
    for first (``_running_calls_await``; ``before_wait`` is called once, if there are any), so
    that the end announced has them as they ended, charged. Without, they are announced as they
    are: only the reaper closes so, for a job whose worker died (it must not sit on its round).

    A caller that claimed ``closed_at`` before (it passes no ``job``, or one closed) has it given
    back should a statement fail before the end is announced: a row held locked (the reaper's
    statements wait on a lock a moment only), an outage. The job is then found with its close
    undone and closed again (``_exec_jobs_close_left``); left claimed, its queued calls stayed open,
    its key live and its session on it, its end never announced."""
    given, claimed = job, job is None or job.closed_at is not None
    try:
        key_used = job_keys_revoke(exec_job_id=job_id) if key_made else False
        if job is None:
            # The job and its calls in one read: what its end announces, and the calls it left open.
            job = exec_job_with_calls(job_id=job_id)
        elif bridge_calls == 0 and not key_used:
            # It has no calls, and nothing to read: its sandbox made none, and the only other way to
            # make one, its job key over HTTP, was never used (a key's first use is recorded before
            # the call is admitted, and no call is admitted once the job's end is stored).
            rows.prefetched(job, "tool_calls", [])
        else:
            prefetch_related_objects([job], CALLS_IN_ORDER)
        # A job not closed as its end was stored (it made calls, or was cancelled as it ran): closed_at
        # is claimed here, before its end is announced (the reaper may have closed it, if this worker
        # stopped renewing its lease).
        to_claim = job.closed_at is None
        if job.session_id is not None:  # before the end is announced: whoever sees it can send the next job
            exec_session_job_ended(session_id=job.session_id, job_id=job.pk)
        # Calls left open (usually none): queued ones fail as never run (a tools worker that claimed one
        # finishes it); ones waiting on the client or an approval fail too, so a late answer finds them
        # ended (409). Each one's price held goes back, and watchers see it end.
        left = [call for call in job.tool_calls.all() if call.status in ToolCall.OPEN]
        queued = [call for call in left if call.status == ToolCall.Status.EXECUTING and call.claimed_at is None]
        tool_calls_fail_queued(queued, error=call_error("job_ended", JOB_ENDED_MESSAGE), running=False)
        for call in left:
            if call.status in ToolCall.AWAITING:
                error = call_error("job_ended", "the job ended while this call was waiting; it was not run")
                tool_call_finish(call_id=call.call_id, error=error)
        if left and await_running:
            # What is still executing now was claimed by a tools worker: read again, not taken from
            # ``left``, where a claim committed as the job ended may not show yet (its call was then
            # not failed above: the failure waited for the claim, and found the call claimed).
            executing = ToolCall.objects.filter(call_id__in=[call.call_id for call in left], status=ToolCall.Status.EXECUTING)
            running = list(executing.values_list("call_id", flat=True))
            if running:
                if before_wait is not None:
                    before_wait()
                _running_calls_await(job_id=job.pk, job_call_id=job.call_id, call_ids=running)
        if to_claim and not ExecJob.objects.filter(pk=job_id, closed_at__isnull=True).update(closed_at=timezone.now()):
            logger.warning("a job's end was announced by the reaper as its worker closed it", extra={"job_id": str(job_id)})
            return job
        if left:
            job = exec_job_with_calls(job_id=job_id)  # their ends are part of the job's
    except DatabaseError:
        if claimed and _exec_job_close_undo(job_id=job_id) and given is not None:
            given.closed_at = None  # a retry with it (db_retry) claims the close again, and announces
        raise
    _exec_job_ended(job, tail=tail)
    return job


def _exec_job_close_undo(*, job_id: Any) -> bool:
    """Give back the claim of a job's close cut short (``_exec_job_close``): the reaper closes it
    again. Return whether it was given back."""
    try:
        ExecJob.objects.filter(pk=job_id, closed_at__isnull=False).update(closed_at=None)
    except DatabaseError:  # an outage; or in a transaction the error broke, whose rollback gives it back
        logger.warning("a job's close was cut short and could not be given back", extra={"job_id": str(job_id)}, exc_info=True)
        return False
    return True


def _running_calls_await(*, job_id: Any, job_call_id: str, call_ids: list[str]) -> None:
    """Wait for calls that tools workers were running when their job ended to end; fail those
    still open at their deadline as the bridge fails an overdue call (``tool_timeout``: a result
    that comes later is dropped, and what was held for it goes back).

    Why wait: such a call is never stopped (the tool is already under way, and may have had its
    effects), and it is charged when it completes. Announced before that, the job's end (exec_end,
    the End its waiters and a cancel get) showed it executing and ``credits_charged`` short of what
    the account was charged, and a client takes an end as final. Failing it at the end instead
    would leave a call that ran uncharged, or charge one that then failed.

    For how long: each call, until the deadline the bridge would have given it (its claim, plus
    its tool's timeout, plus CALL_GRACE_SECONDS), the time a tools worker may hold it. The wait
    is pushed (each call's result is published on its job's channel), and a job's worker that
    waits holds its slot no longer than the job would have, had it waited for that call itself."""
    deadline = calls_overdue_at(ToolCall.objects.filter(call_id__in=call_ids)) or timezone.now()
    open_calls = ToolCall.objects.filter(call_id__in=call_ids, status__in=ToolCall.OPEN)
    waited = time.monotonic()
    try:
        with backplane().subscribe(job_channel(job_call_id)) as subscription:
            # Subscribed before the records are asked: a result pushed in between wakes the wait.
            while open_calls.exists() and (left := (deadline - timezone.now()).total_seconds()) > 0:
                # The job's lease, renewed while its worker waits: a job cancelled as it ran is not
                # closed until then, and the reaper closes it only once its lease lapses (this
                # worker died). A wake-up a heartbeat also asks the records, should a push be lost.
                ExecJob.objects.filter(pk=job_id).update(heartbeat_at=timezone.now())
                connection.close()  # not held while blocked: the pool is for those who query
                subscription.wait(min(left, settings.PTC_JOB_HEARTBEAT_SECONDS))
                subscription.drain()
    except (OperationalError, InterfaceError):
        raise  # the close is retried (db_retry), wait and all
    except Exception:  # the channel is unreachable: so is the end's announcement; the records decide
        logger.warning("could not wait for a job's running calls: its channel is unreachable", exc_info=True)
    for call_id in open_calls.values_list("call_id", flat=True):
        tool_call_finish(call_id=call_id, error=call_error("tool_timeout", CALL_TIMEOUT_MESSAGE))
    logger.info(
        "the job's end waited for its running calls",
        extra={"job_id": str(job_id), "calls": len(call_ids), "ms": round((time.monotonic() - waited) * 1000, 2)},
    )


def _exec_job_ended(job: ExecJob, *, tail: Sequence[tuple[str, str]]) -> str:
    """Announce a job's end: the output its events had not carried yet (``tail``) and its last
    event, then the ``End`` on its end channel that wakes its waiters, with the job as the API
    shows it (unless too large to push), all in one round trip. ``job`` comes with its calls.
    Return its status."""
    view = job_view(job)
    pushed = view if len(json.dumps(view, default=str)) <= END_PUSH_MAX_BYTES else None
    backplane().append_then_publish(
        [(job.call_id, [*output_events(tail), ("exec_end", job_end_payload(view))])],
        [(job_end_channel(job.call_id), End(status=view["status"], job=pushed))],
    )
    return view["status"]


def _exec_job_fail_if(*, job_id: str, status: str, kind: str, message: str, stale: bool = False) -> bool:
    """Fail the job if it is still in ``status`` (and, with ``stale``, its heartbeat has lapsed)."""
    jobs = ExecJob.objects.filter(pk=job_id, status=status)
    if stale:
        jobs = jobs.filter(heartbeat_at__lt=timezone.now() - timedelta(seconds=settings.PTC_JOB_LEASE_SECONDS))
    now = timezone.now()
    fields: dict[str, Any] = {"status": Status.FAILED, "finished_at": now, "closed_at": now, "error": job_error(kind, message)}
    if status == Status.RUNNING:
        # Its worker died holding the output in memory; what the code printed went out as events.
        # Stored with the status, in one UPDATE: whoever sees the job failed sees its output too.
        call_id = jobs.values_list("call_id", flat=True).first()
        if call_id is None:
            return False
        fields.update(_printed_from_events(call_id))
    updated = jobs.update(**fields)
    if updated:
        _exec_job_close(job_id=job_id)
        # Counted here, as no worker will: a job lost with its worker is what PtcJobsFailing is for.
        job_finished_observe(status=Status.FAILED, toolsets=[], seconds=None, spawn_ms=None)
    return bool(updated)


def exec_job_fail_queued(*, job_id: Any, reason: str) -> bool:
    """Fail a job still queued because its session ended (for ``reason``): it would wait for a
    sandbox that is gone. Return whether it was failed here."""
    message = session_ended_before_start(reason)
    return _exec_job_fail_if(job_id=str(job_id), status=Status.QUEUED, kind="SessionEnded", message=message)


def exec_job_submit(*, wait: float, **create: Any) -> tuple[ExecJob, End | None]:
    """Create a job (``exec_job_create``'s arguments) and block up to ``wait`` seconds for its end.
    Return the job as created and its ``End`` if it ended in time (its ``job`` is what it ended
    as; None when too large to push: read the record).

    Its end channel is subscribed before the job is queued, so its end can't be missed, and no
    query asks whether it has ended. If the backplane can't be reached, it does not wait: the
    caller shows the job as it is."""
    call_id = new_exec_call_id()
    subscription: Subscription | None = None
    if wait > 0:
        try:
            # Redis confirms it while the job is checked and recorded; it is confirmed before the job is queued.
            subscription = backplane().subscribe(job_end_channel(call_id), confirmed=False)
        except Exception:  # no push to wait for; the job is shown as it is now
            logger.warning("cannot wait for a job: its channel is unreachable", exc_info=True)

    def confirmed() -> None:
        nonlocal subscription
        try:
            if subscription is not None:
                subscription.confirm()
        except Exception:  # closed by confirm(); the job is queued regardless, and shown as it is now
            logger.warning("cannot wait for a job: its channel is unreachable", exc_info=True)
            subscription = None

    with subscription or nullcontext():
        job = exec_job_create(call_id=call_id, before_enqueue=confirmed, **create)
        return job, _job_end_await(subscription, job=job, seconds=wait) if subscription is not None else None


def _job_ended(job: ExecJob) -> str:
    """The job's status if it has finished, else ``""``."""
    return ExecJob.objects.filter(pk=job.pk, status__in=ExecJob.FINISHED).values_list("status", flat=True).first() or ""


def _job_end_await(subscription: Subscription, *, job: ExecJob, seconds: float) -> End | None:
    deadline = time.monotonic() + seconds
    while (remaining := deadline - time.monotonic()) > 0:
        connection.close()  # not held while blocked: the pool is for those who query
        subscription.wait(remaining)
        for message in subscription.drain():
            if isinstance(message, End):
                return message
            # The channel reconnected: an end pushed meanwhile is lost; the record is not.
            if isinstance(message, Resync) and (status := _job_ended(job)):
                return End(status=status)
    return None


def exec_job_cancel(*, job: ExecJob) -> ExecJob:
    """Cancel a queued or running job: its sandbox is killed and its unstarted tool calls never run.

    Raise ApplicationError ``job_finished`` (409) if it has already ended.
    """
    now = timezone.now()
    cancelled = {
        "status": Status.CANCELLED,
        "finished_at": now,
        "error": {"type": "Cancelled", "message": "the job was cancelled", "traceback": ""},
    }
    # Closed here if it never started, or is a container's (no worker); else its worker closes it.
    was_queued = ExecJob.objects.filter(pk=job.pk, status=Status.QUEUED).update(**cancelled, closed_at=now)
    was_running = not was_queued and ExecJob.objects.filter(pk=job.pk, status=Status.RUNNING).update(**cancelled)
    job.refresh_from_db()
    if not (was_queued or was_running):
        raise ApplicationError("job_finished", f"The job has already finished with status '{job.status}'.", status=409)
    if was_queued:
        _exec_job_close(job_id=job.pk)  # no worker will: it never started
        job_finished_observe(status=Status.CANCELLED, toolsets=[], seconds=None, spawn_ms=None)
    elif job.container_id:
        # No worker will, and no request should wait for a tool: while a tools worker runs one of
        # its calls, the reaper closes it once they have ended (_exec_jobs_close_left), its end
        # announced with them ended and charged.
        if not _calls_still_running(job_id=job.pk) and ExecJob.objects.filter(pk=job.pk, closed_at__isnull=True).update(
            closed_at=now
        ):
            _exec_job_close(job_id=job.pk)
            job_finished_observe(status=Status.CANCELLED, toolsets=[], seconds=None, spawn_ms=None)
    else:
        job_keys_revoke(exec_job_id=job.pk)
        # Its worker kills the sandbox and ends the job; if this push is lost, its next heartbeat
        # finds the job cancelled.
        backplane().publish(job_channel(job.call_id), Cancel())
    return job


# What a cancel's answer waits for a running job's worker besides its calls: the worker hears the
# cancel at once (pushed), or at its next heartbeat if the push was lost, then kills the sandbox.
CANCEL_END_SLACK_SECONDS = 5.0
# The most a cancel's answer waits for the job's end: a call a tools worker runs may take its
# tool's whole timeout. Past it, the answer is the job as recorded, and exec_end follows.
CANCEL_ANSWER_SECONDS = 10.0
# ... and for a job whose worker missed its lease's renewals (_worker_missed_beats).
CANCEL_MISSED_BEATS_SECONDS = 1.0


def _worker_missed_beats(job: ExecJob) -> bool:
    """Whether the worker running ``job`` has not renewed its lease for two heartbeats."""
    missed = timezone.now() - timedelta(seconds=2 * settings.PTC_JOB_HEARTBEAT_SECONDS)
    return not job.container_id and job.heartbeat_at is not None and job.heartbeat_at < missed


def exec_job_cancel_await(*, job: ExecJob) -> End | None:
    """Cancel ``job`` (``exec_job_cancel``) and wait for its end to be announced. Return its ``End``
    (its ``job`` is what it ended as, with the calls a tools worker was still running ended and
    charged; None when too large to push: read the record), or None if it did not come in time
    (the worker died, or the push was lost): the record is then the best there is.

    How long: as long as its end waits for those calls (``_running_calls_await``: each call's tool
    timeout plus CALL_GRACE_SECONDS from its claim, at most) plus CANCEL_END_SLACK_SECONDS and a
    heartbeat for its worker, and at most CANCEL_ANSWER_SECONDS. Nothing running: the end comes in
    milliseconds.

    Raise ApplicationError ``job_finished`` (409) if it has already ended."""
    try:
        subscription: Subscription | None = backplane().subscribe(job_end_channel(job.call_id))
    except Exception:  # no push to wait for; the job is shown as it is now
        logger.warning("cannot wait for a cancelled job's end: its channel is unreachable", exc_info=True)
        subscription = None
    with subscription or nullcontext():
        exec_job_cancel(job=job)
        if subscription is None:
            return None
        running = ToolCall.objects.filter(exec_job_id=job.pk, status=ToolCall.Status.EXECUTING, claimed_at__isnull=False)
        deadline = calls_overdue_at(running)
        calls = max((deadline - timezone.now()).total_seconds(), 0.0) if deadline is not None else 0.0
        seconds = min(calls + settings.PTC_JOB_HEARTBEAT_SECONDS + CANCEL_END_SLACK_SECONDS, CANCEL_ANSWER_SECONDS)
        if _worker_missed_beats(job):
            # Its worker has not renewed its lease for two beats: most likely dead, and the reaper's
            # to close. Alive, it hears the cancel pushed at once; the answer waits no longer for it.
            seconds = min(seconds, CANCEL_MISSED_BEATS_SECONDS)
        end = _job_end_await(subscription, job=job, seconds=seconds)
        # After a reconnect, _job_end_await answers from the record (the job is cancelled there
        # already): no job comes with that End, and the record is read.
        return end


# Until when this process's reaper trusts no lapsed lease: after it found the database unreachable,
# every lease lapsed for all alike, and live workers (and finishers retrying their record) need
# time to renew theirs. A whole lease: after an outage, a dead worker is found one lease later.
_reaper_blind_until = 0.0
# The running jobs whose rows this process's reaper found held locked: their workers' renewals waited on the lock.
_reaper_found_locked = LockedRows(ExecJob, "pk")


def exec_jobs_reap() -> int:
    """Fail running jobs whose worker stopped renewing their lease, calls whose tools worker did
    the same, and calls abandoned otherwise. Return how many jobs were failed."""
    global _reaper_blind_until
    try:
        # Credits that dead workers left held: how each call ended decides.
        tool_calls_close_held()
    except (OperationalError, InterfaceError):
        _reaper_blind_until = time.monotonic() + settings.PTC_JOB_LEASE_SECONDS
        raise
    if time.monotonic() < _reaper_blind_until:
        return 0
    tool_calls_reap()
    exec_sessions_reap()
    stale = timezone.now() - timedelta(seconds=settings.PTC_JOB_LEASE_SECONDS)
    # Abandoned: a call no tools worker ever claimed (its message lost) whose job is over, or one
    # claimed past any tool's timeout (its worker renews its lease, but its tool never returned). A
    # claimed call within that is its lease's to end (tool_calls_reap), however long its tool runs.
    # From its claim, not its start: a gated call starts when it begins to wait for its approval.
    abandoned = timezone.now() - timedelta(seconds=settings.PTC_DEFAULT_TOOL_TIMEOUT * 2 + settings.PTC_JOB_LEASE_SECONDS)
    overdue = timezone.now() - timedelta(seconds=settings.PTC_TIMEOUT_CEILING + 2 * settings.PTC_JOB_LEASE_SECONDS)
    # A managed container's job runs until cancelled or closed idle: its call that no worker took (the
    # web process that recorded it and held its price died before it queued it) is abandoned as a
    # standalone call is, or it stayed executing, its price held, for the job's life.
    in_container = Exists(ExecJob.objects.filter(pk=OuterRef("exec_job_id")).exclude(container_id=""))
    never_taken = Q(~call_job_running() | in_container) & Q(claimed_at__isnull=True, started_at__lt=abandoned)
    stuck = Q(claimed_at__lt=overdue)
    # Each round's work is done a job or a call at a time, and one whose row a stuck transaction
    # holds locked waits for a later round (unless_locked: its statements wait on a lock a moment,
    # then are cancelled): it ended the round, and no job of anyone's was reaped past it while the
    # lock was held; then it cost the round PTC_DB_STATEMENT_TIMEOUT, at every round, for each such
    # row. The abandoned calls' rows are skipped while locked.
    with transaction.atomic():
        abandoned_calls = ToolCall.objects.select_for_update(skip_locked=True).filter(
            never_taken | stuck, status=ToolCall.Status.EXECUTING
        )
        ToolCall.objects.filter(pk__in=list(abandoned_calls.values_list("pk", flat=True))).update(
            status=ToolCall.Status.FAILED,
            error=call_error("worker_lost", "no tools worker finished this call; it was abandoned"),
            finished_at=timezone.now(),
        )
    lost = timezone.now() - timedelta(seconds=settings.PTC_QUEUED_MAX_SECONDS)
    for job_id in ExecJob.objects.filter(status=Status.QUEUED, created_at__lt=lost).values_list("pk", flat=True):
        unless_locked(
            functools.partial(
                _exec_job_fail_if,
                job_id=str(job_id),
                status=Status.QUEUED,
                kind="WorkerLost",
                message=f"no exec worker took the job within {settings.PTC_QUEUED_MAX_SECONDS} s; its queue message was lost",
            ),
            what="failing a job lost in the queue",
            job_id=str(job_id),
        )
    _exec_jobs_close_left()
    container_jobs_close_idle()
    reaped = 0
    # A managed container's job has no worker and no lease: it is not reaped, only closed once idle (above).
    running = ExecJob.objects.run_here().filter(status=Status.RUNNING, heartbeat_at__lt=stale)
    lapsed = list(running.values_list("pk", flat=True))
    _reaper_found_locked.keep_only(set(lapsed))
    for job_id in lapsed:
        if _reaper_found_locked.waits(job_id):
            continue  # its worker's renewals waited on the lock its row was held by: judged later
        failed = unless_locked(functools.partial(_exec_job_reap, job_id=job_id), what="reaping a job", job_id=str(job_id))
        if failed is None:
            _reaper_found_locked.held(job_id)
        reaped += bool(failed)
    return reaped


def _exec_job_reap(*, job_id: Any) -> bool:
    """Fail a running job whose lease lapsed (its worker died), once its calls have ended. Return
    whether it was failed here."""
    if _calls_still_running(job_id=job_id):
        return False  # ended once they have: its end, announced here without waiting, is then final
    return _exec_job_fail_if(
        job_id=str(job_id),
        stale=True,
        status=Status.RUNNING,
        kind="WorkerLost",
        message="the worker running this job stopped renewing its lease; the job was ended",
    )


def _exec_jobs_close_left() -> None:
    """Close the ended jobs whose worker died before it closed them (their calls left open and their
    prices held, their end never announced): those cancelled as they ran, and those that ended with
    calls, killed while the close waited for them. Once their worker, alive, would have given up
    recording their end (a lease, and its retries through a database outage). What a cancelled
    job's code printed is kept from the events, as for a job whose worker died (the others had
    theirs stored with their end).

    A worker alive whose close waits for the job's running calls renews the job's lease meanwhile
    (_running_calls_await): the job is left to it until that lapses too.

    ``closed_at`` is claimed by whoever closes the job, before the end is announced: a close that
    fails before its claim (the database gone past the retries) is found here and done again; one
    that fails after it (Redis away as the end was appended) is not, and its readers take the end
    from the records (events._end_lost)."""
    stale = timezone.now() - timedelta(seconds=settings.PTC_JOB_LEASE_SECONDS + settings.PTC_DB_RETRY_SECONDS)
    lapsed = Q(heartbeat_at__isnull=True) | Q(heartbeat_at__lt=timezone.now() - timedelta(seconds=settings.PTC_JOB_LEASE_SECONDS))
    # A managed container's, cancelled as a tools worker ran a call of it, has no worker: at once. Nor
    # has one no worker took (failed or cancelled while queued), whose close was given back: whoever
    # ended it (the reaper, a cancel, a session's end) does not try again, so it waited out a worker's
    # retries there were none of, its end unannounced and its session busy (cancelled) for as long.
    unowned = Q(lapsed, finished_at__lt=stale) | ~Q(container_id="") | Q(started_at__isnull=True)
    # Ended as the partial index of ended, unclosed jobs says it (execjob_ended_unclosed), for every
    # branch: by the status alone, a branch (a container's) read every job of its kind ever run.
    ended_unclosed = Q(status__in=ExecJob.FINISHED, finished_at__isnull=False, closed_at__isnull=True)
    left = ExecJob.objects.filter(unowned, ended_unclosed)
    for job_id, call_id, container_id, status in left.values_list("pk", "call_id", "container_id", "status"):
        close = functools.partial(_exec_job_close_left, job_id=job_id, call_id=call_id, container_id=container_id, status=status)
        unless_locked(close, what="closing an ended job", job_id=str(job_id))


def _exec_job_close_left(*, job_id: Any, call_id: str, container_id: str, status: str) -> None:
    if _calls_still_running(job_id=job_id):
        return  # closed once they have: its end, announced here without waiting, is then final
    if not container_id:
        logger.warning("a job ended and its worker did not close it; closing it", extra={"job_id": str(job_id)})
    printed = _printed_from_events(call_id) if status == Status.CANCELLED else {}
    if ExecJob.objects.filter(pk=job_id, closed_at__isnull=True).update(closed_at=timezone.now(), **printed):
        _exec_job_close(job_id=job_id)
        # Counted by whoever closes a job: here, as no worker did.
        job_finished_observe(status=status, toolsets=[], seconds=None, spawn_ms=None)


def container_jobs_close_idle() -> int:
    """Close the managed containers' jobs with no call for PTC_CONTAINER_IDLE_SECONDS (0: never)
    and none still open: each ends ``completed``, its end announced and counted as any job's, and a
    later call of its container is refused (409 ``job_finished``). Return how many were closed.

    A closed job's ``finished_at`` is its last call's end, when it was last used, not the close's
    time an idle period later (``closed_at``): its duration is the time it was in use.

    A container's job is made by its first call, named by the client: without this, each stayed
    open for good (and held a place in PTC_MAX_CONTAINERS_PER_USER).

    Each round finds the jobs by their ``last_call_at`` alone; only a job found idle has its calls
    read, once, to confirm it (a call recorded by a process that does not keep it, or one whose
    end its web process never saw, as it died): one not idle after all has it set from them."""
    idle = settings.PTC_CONTAINER_IDLE_SECONDS
    if not idle:
        return 0
    since = timezone.now() - timedelta(seconds=idle)
    closed = 0
    for job_id in container_jobs_idle(since=since).order_by().values_list("pk", flat=True):
        close = functools.partial(_container_job_close_idle, job_id=job_id, since=since)
        closed += bool(unless_locked(close, what="closing an idle container's job", job_id=str(job_id)))
    return closed


def _container_job_close_idle(*, job_id: Any, since: datetime) -> bool:
    with transaction.atomic():
        # A call of it is recorded under this lock (exec_job_for_container): once it is held,
        # a call recorded is seen below (each statement reads what was committed before it),
        # and a call not yet recorded finds the job ended. Held by another (a call being
        # recorded, or a transaction stuck elsewhere): not idle, or not now.
        started = (
            ExecJob.objects.select_for_update(skip_locked=True)
            .filter(pk=job_id, status=Status.RUNNING)
            .values_list("started_at", flat=True)
            .first()
        )
        if started is None:
            return False  # cancelled meanwhile, or its row held
        last, open_call = container_job_calls_last(job_id=job_id)
        last = max(last or started, started)
        if last >= since:  # called meanwhile, or its last_call_at was behind its calls'
            unknown = Q(last_call_at__isnull=True) | Q(last_call_at__lt=last)
            ExecJob.objects.filter(unknown, pk=job_id).update(last_call_at=last)
            return False
        if open_call:
            return False  # a call under way longer than the idle time: idle from its end
        ExecJob.objects.filter(pk=job_id).update(
            status=Status.COMPLETED, finished_at=last, closed_at=timezone.now(), last_call_at=last
        )
    logger.info(
        "managed container job closed: idle", extra={"job_id": str(job_id), "idle_seconds": settings.PTC_CONTAINER_IDLE_SECONDS}
    )
    _exec_job_close(job_id=job_id)  # no call is open: nothing to wait for
    job_finished_observe(status=Status.COMPLETED, toolsets=[], seconds=None, spawn_ms=None)
    return True


def _calls_still_running(*, job_id: Any) -> bool:
    """Return True if a tools worker still runs a call of the job: claimed, its lease renewed,
    and short of its deadline (calls_overdue_at).

    The reaper ends (or closes) a job whose worker died only once such calls have ended: it
    announces the end without waiting (it must not sit on its round), and announced before they
    end, the end showed them executing and uncharged (they complete, and are charged, after). A
    round or so after they end, or once they pass their deadline (a hung tool), or their worker's
    lease lapses (tool_calls_reap fails them): bounded, so no job stays running for ever. Their job
    is still running meanwhile, as it was for the lease before it was found stale: a call it had
    queued may still be claimed, and waited for in turn."""
    now = timezone.now()
    leased = ToolCall.objects.filter(exec_job_id=job_id, status=ToolCall.Status.EXECUTING, claimed_at__isnull=False)
    fresh = leased.annotate(lease=Coalesce("heartbeat_at", "claimed_at")).filter(
        lease__gte=now - timedelta(seconds=settings.PTC_JOB_LEASE_SECONDS)
    )
    deadline = calls_overdue_at(fresh)
    return deadline is not None and deadline > now


def _printed_from_events(call_id: str) -> dict[str, Any]:
    """What a job's code printed, as its events carried it, for a job whose worker died holding its
    output: each stream's text, written where the job has none stored (a worker that stored its
    own before it died keeps it)."""
    return {
        name: Case(When(**{name: ""}, then=Value(storable(text))), default=F(name), output_field=TextField())
        for name, text in output_from_stream(job_call_id=call_id).items()
    }


def worker_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"
