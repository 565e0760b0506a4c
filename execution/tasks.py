"""The tasks of both queues. Each is thin: it takes ids, calls one service and decides on retries.

exec:  run_exec (one job in its sandbox)
maintenance (every worker): reap_jobs (beat's reaper), purge_jobs (retention)
tools: execute_tool (one tool call)
"""

import logging
from typing import Any

from celery import shared_task
from celery.exceptions import Retry
from celery.signals import worker_ready, worker_shutdown
from celery.utils.time import get_exponential_backoff_interval
from django.conf import settings
from django.db import InterfaceError, OperationalError

from execution.sandbox import process
from execution.sandbox.pool import warm_pool
from execution.services.calls import (
    OutcomeUnrecorded,
    RetryCarries,
    tool_call_abort,
    tool_call_execute,
    tool_call_outcome_keep,
    tool_calls_heartbeat,
)
from execution.services.jobs import CALL_ID_HEADER, exec_job_run, exec_jobs_reap, worker_name
from execution.services.retention import exec_jobs_purge
from execution.services.sessions import exec_sessions_heartbeat, exec_sessions_shutdown
from ptcproject import metrics, queues
from ptcproject.heap import heap_freeze
from ptcproject.periodic import run_every

logger = logging.getLogger("ptc.execution")


# No soft or hard time limit: the threads pool can't enforce them. The session kills the sandbox at
# the job's own timeout, and everything after the claim ends the job whatever fails.
@shared_task(
    queue=queues.EXEC,
    acks_late=True,
    # Only the claim raises, and only when the database is unreachable (or cancels it): a job
    # accepted during a PostgreSQL restart runs as soon as it is back. The claim makes a retry safe;
    # past PTC_QUEUED_MAX_SECONDS a failed claim is not retried (the job is failed, or left to the
    # reaper, which fails it), and the claim of one the reaper failed finds nothing to do.
    autoretry_for=(OperationalError, InterfaceError),
    retry_backoff=1,
    retry_backoff_max=5,
    retry_jitter=False,
    max_retries=settings.PTC_QUEUED_MAX_SECONDS // 5,
)
def run_exec(job_id: str) -> None:
    # The node name routes a session's later jobs here, to its direct queue (<nodename>.dq2).
    call_id = (run_exec.request.headers or {}).get(CALL_ID_HEADER, "")
    exec_job_run(job_id=job_id, worker=worker_name(), node=run_exec.request.hostname or "", call_id=call_id)


@shared_task(queue=queues.MAINTENANCE, acks_late=True)
def reap_jobs() -> int:
    return exec_jobs_reap()


# Beat's retention round. Idempotent (a purged job is skipped), so a redelivery or an overlap is
# harmless; no retry: the next round, PTC_RETENTION_EVERY later, is the retry.
@shared_task(queue=queues.MAINTENANCE, acks_late=True)
def purge_jobs() -> int:
    return exec_jobs_purge()


# No soft or hard time limit: the threads pool can't enforce them. Each kind holds a call to its
# tool's timeout (builtin: a watched thread; http: a deadline on the whole request; mcp: the
# session's read timeout).
@shared_task(
    queue=queues.TOOLS,
    acks_late=True,
    # Only a database that is unreachable for a while is worth a retry; the claim makes a retry
    # safe (one after the call's deadline finds its record failed, and runs nothing). Retried 1, 2,
    # 4, then every 8 s, for about a minute, as long as a worker waits on the database for a job's
    # end (PTC_DB_RETRY_SECONDS): three retries with the backoff's full jitter could all come within
    # a few seconds of one pool's outage, and the call then waited out its deadline, never claimed.
    autoretry_for=(OperationalError, InterfaceError),
    retry_backoff=True,
    retry_backoff_max=8,
    retry_jitter=False,
    max_retries=10,
)
def execute_tool(call_id: str, record: str | None = None, outcome: str | None = None, claim: str | None = None) -> None:
    # ``record``: a job's call, recorded by its claim (services.calls.tool_call_execute). ``outcome``:
    # what it came to, which a try before this one could not record (OutcomeUnrecorded). ``claim``:
    # the claim a try before this one made and did not run (ClaimUnrun).
    try:
        # A retry claims its call on its own, not in the worker's batches (services.calls.tool_call_execute).
        retried = bool(execute_tool.request.retries)
        tool_call_execute(call_id=call_id, record=record, alone=retried, outcome=outcome, claim=claim)
    except RetryCarries as carried:
        if not _kept_past_retries(call_id, carried):
            raise _carried_retry(call_id, carried) from carried
    except (OperationalError, InterfaceError):
        raise
    except Exception:
        # A bug must not leave the code waiting for a result that never comes: fail the call now.
        try:
            tool_call_abort(call_id=call_id, record=record)
        except OutcomeUnrecorded as unrecorded:
            # Its traceback, which the retry's line does not carry (it names the database's error).
            logger.exception("a tool call's task failed", extra={"call_id": call_id})
            if not _kept_past_retries(call_id, unrecorded):
                raise _carried_retry(call_id, unrecorded) from unrecorded
        raise


def _kept_past_retries(call_id: str, carried: RetryCarries) -> bool:
    """Whether this try was its task's last and ``carried`` an outcome (the tool ran, or its failure
    was decided), now kept for the reaper to record (services.calls.tool_call_outcome_keep). Raised
    to the retry that is no more, it was lost: the reaper failed the call worker_lost a lease later,
    and a billed call's hold went back, its tool run and never charged."""
    if execute_tool.request.retries < execute_tool.max_retries or not isinstance(carried, OutcomeUnrecorded):
        return False
    return tool_call_outcome_keep(call_id=call_id, outcome=carried.outcome)


def _carried_retry(call_id: str, carried: RetryCarries) -> Retry:
    """execute_tool's retry with what its try leaves it (the outcome the database did not take, for
    it to record; the claim it did not run, for it to take over), on autoretry_for's backoff and
    bound (past which the database's error is raised). The log and the events show the call id
    only, never its record or its result."""
    countdown = get_exponential_backoff_interval(
        factor=int(execute_tool.retry_backoff),
        retries=execute_tool.request.retries,
        maximum=execute_tool.retry_backoff_max,
        full_jitter=execute_tool.retry_jitter,
    )
    return execute_tool.retry(
        kwargs=carried.kwargs,
        exc=carried.__cause__,
        throw=False,
        countdown=countdown,
        argsrepr=repr((call_id,)),
        kwargsrepr=repr(dict.fromkeys(carried.kwargs, "...")),
    )


def _consumed(sender: Any) -> set[str]:
    """The queues the worker that sent worker_ready consumes (empty if it says nothing of them)."""
    return {q.name for q in getattr(getattr(sender, "task_consumer", None), "queues", [])}


def _consumes(sender: Any, queue: str) -> bool:
    """Whether the worker that sent worker_ready consumes ``queue`` (or says nothing of its queues)."""
    names = _consumed(sender)
    return not names or queue in names


@worker_ready.connect
def _fleet_while_up(sender: Any = None, **_: Any) -> None:
    """A worker on other tools queues only (-Q tools.slow) renews its calls' leases like a tools
    worker; every worker says it is alive on its queues (ptc_queue_workers) and serves its own
    metrics when PTC_METRICS_PORT says so."""
    if not _consumes(sender, queues.TOOLS) and any(_consumes(sender, queue) for queue in queues.tools_queues()):
        run_every("ptc-call-leases", settings.PTC_JOB_HEARTBEAT_SECONDS, tool_calls_heartbeat)

    consumed, name = sorted(_consumed(sender)), worker_name()
    run_every(
        "ptc-presence", metrics.PRESENCE_EVERY, lambda: metrics.worker_presence_beat(consumed=consumed, name=name), now=True
    )
    worker_shutdown.connect(lambda **_: metrics.worker_presence_leave(consumed=consumed, name=name), weak=False)
    metrics.worker_metrics_serve()


@worker_ready.connect
def _leases_while_up(sender: Any = None, **_: Any) -> None:
    """An exec worker fails the jobs and calls whose worker died, at start and then every
    PTC_REAP_EVERY seconds: leases are enforced while any exec worker runs, with or without beat.
    A tools worker renews the lease of every call it runs, so the reaper can tell when it died."""
    if _consumes(sender, queues.EXEC):
        run_every("ptc-reaper", settings.PTC_REAP_EVERY, exec_jobs_reap, now=True)
        # The leases of the sessions whose sandboxes this worker holds.
        run_every("ptc-session-leases", settings.PTC_JOB_HEARTBEAT_SECONDS, exec_sessions_heartbeat)
        try:
            process.check()
            process.trial()
        except process.SandboxUnavailable as exc:  # said at start, not first at a user's job
            logger.error("this exec worker cannot run sandboxes: %s", exc)
        else:
            warm_pool().start()
    if _consumes(sender, queues.TOOLS):
        run_every("ptc-call-leases", settings.PTC_JOB_HEARTBEAT_SECONDS, tool_calls_heartbeat)


@worker_ready.connect
def _heap_frozen(**_: Any) -> None:
    """What the worker's start made is frozen out of the collector's sight (ptcproject/heap.py)."""
    heap_freeze()


@worker_shutdown.connect
def _pool_down(**_: Any) -> None:
    """Warm sandboxes that no job took are killed with their worker, never left behind; so are its
    sessions' sandboxes, and those sessions end ``lost`` (a warm shutdown has let their jobs end)."""
    exec_sessions_shutdown()
    warm_pool().close()
