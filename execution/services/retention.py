"""Retention: empty what old finished jobs carried (code, output, return value, files, tool-call
inputs and outputs), and the files of old ended sessions; keep every record of what they did and cost.

The charges stay whole: ToolCall rows (with their credits, status, toolset, tool, times and error
code), CreditUsage rows, reservations and the ledger are never touched. Run by beat
(``execution.tasks.purge_jobs``); safe to run twice or on two workers at once: a job is purged by a
conditional update on ``purged_at IS NULL``, and emptying twice gives the same row.
"""

import logging
from collections import defaultdict
from datetime import datetime, timedelta
from uuid import UUID

from django.conf import settings
from django.db import transaction
from django.db.models import Exists, F, OuterRef, Q, QuerySet, Sum, TextField
from django.db.models.functions import Cast, Coalesce, Greatest, Length
from django.utils import timezone

from execution.backplane import backplane
from execution.models import ExecJob, ExecSession, ToolCall, WorkFile
from ptcproject.accounts.models import UserSettings
from ptcproject.db import statement_timeout_off

logger = logging.getLogger("ptc.execution")
PURGE_BATCH = 500
# What a purged error's message reads.
PURGED = "(removed by retention)"


def _cutoffs(*, now: datetime) -> list[tuple[Q, datetime]]:
    """Whose rows finished before when are past retention: one (users, cutoff) per retention in force.

    Users with their own ``retention_days`` (grouped by it; none for a retention longer than the
    calendar reaches back), then everyone else at PTC_RETENTION_DAYS, unless it is unset (kept forever).
    """
    overrides = UserSettings.objects.filter(retention_days__isnull=False)
    by_days: dict[int, list[int]] = defaultdict(list)
    for user_id, days in overrides.values_list("user_id", "retention_days"):
        if days is not None:  # the filter says so; mypy can't see it
            by_days[days].append(user_id)
    cutoffs = []
    for days, users in by_days.items():
        # The admin takes any days the column holds (up to 2**31 - 1): a retention reaching back past
        # the calendar's start (about 739,000 days) keeps everything, and its OverflowError ended
        # every round, so nobody's jobs were purged.
        if days < (now - datetime.min.replace(tzinfo=now.tzinfo)).days:
            cutoffs.append((Q(user_id__in=users), now - timedelta(days=days)))
    if settings.PTC_RETENTION_DAYS is not None:
        cutoffs.append((~Q(user_id__in=overrides.values("user_id")), now - timedelta(days=settings.PTC_RETENTION_DAYS)))
    return cutoffs


def _exec_jobs_purge_batch(*, ids: list[UUID], now: datetime) -> list[str]:
    """Empty these jobs and their calls in one transaction; return the call_ids of those this run purged."""
    with transaction.atomic():
        # The lock and the purged_at condition make two purges at once empty each job once.
        claimed = list(
            ExecJob.objects.select_for_update(skip_locked=True)
            .filter(pk__in=ids, purged_at__isnull=True)
            .values_list("pk", "call_id", "error")
        )
        if not claimed:
            return []
        for pk, _, error in claimed:
            # The error's type says what happened; its message and traceback may quote the code or its data.
            kept = {"type": error.get("type", ""), "message": PURGED, "traceback": ""} if isinstance(error, dict) else None
            ExecJob.objects.filter(pk=pk).update(code="", stdout="", stderr="", return_value=None, error=kept, purged_at=now)
        jobs = [pk for pk, _, _ in claimed]
        _tool_calls_empty(ToolCall.objects.filter(exec_job_id__in=jobs))
        # The files it was given and those its code wrote are its input and output too (its
        # output_files still list their paths and sizes). A session's stay the session's.
        WorkFile.objects.filter(exec_job_id__in=jobs).delete()
    return [call_id for _, call_id, _ in claimed]


def _tool_calls_empty(calls: QuerySet[ToolCall]) -> int:
    """Empty the calls' inputs and outputs, and their errors' messages (an HTTP tool's error quotes
    its answer), keeping each error's code. Return how many calls there were."""
    for pk, error in calls.filter(error__isnull=False).values_list("pk", "error"):
        if isinstance(error, dict) and error.get("message") != PURGED:
            ToolCall.objects.filter(pk=pk).update(error={"code": error.get("code", ""), "message": PURGED})
    return calls.update(input={}, output=None)


def _container_bytes_freed(calls: QuerySet[ToolCall]) -> None:
    """Take what ``calls`` (about to be emptied) passed off their managed containers' jobs' count
    against PTC_MAX_JOB_TOOL_BYTES: their views no longer carry it, and a container may call back
    for as long as it lives."""
    text = TextField()
    sizes = (
        calls.exclude(exec_job=None)
        .values("exec_job_id")
        .annotate(size=Sum(Coalesce(Length(Cast("input", text)), 0) + Coalesce(Length(Cast("output", text)), 0)))
    )
    for row in sizes:
        freed = Greatest(F("http_tool_bytes") - row["size"], 0)
        ExecJob.objects.filter(pk=row["exec_job_id"]).exclude(container_id="").update(http_tool_bytes=freed)


def event_logs_expire() -> int:
    """Drop the event logs not written for PTC_EVENTS_RETENTION_SECONDS whose jobs have ended and
    been closed (or are gone): the embedded backplane's files (Redis expires its own). Return how many."""
    try:
        idle = backplane().events_idle(settings.PTC_EVENTS_RETENTION_SECONDS)
    except OSError:  # as a purge's drop of the logs: logged, and not the purge's end (it runs after)
        logger.warning("could not list the event logs to expire", exc_info=True)
        return 0
    # As for a purge, not while a job is not closed, nor while a call of it is open: its close (its
    # worker's, waiting for its running calls, or the reaper's) appends its end, the reaper reads a
    # cancelled job's output from the log, and a call that outlives the job appends its own end.
    # Dropped before, those went to a new file, and its readers, at offsets of the old, missed them.
    open_calls = ToolCall.objects.filter(exec_job=OuterRef("pk"), status__in=ToolCall.OPEN)
    writing = ~Q(status__in=ExecJob.FINISHED) | Q(closed_at__isnull=True) | Exists(open_calls)
    dropped = 0
    for at in range(0, len(idle), PURGE_BATCH):
        batch = idle[at : at + PURGE_BATCH]
        running = ExecJob.objects.filter(writing, call_id__in=batch)
        live = set(running.values_list("call_id", flat=True))
        try:
            backplane().events_drop([call_id for call_id in batch if call_id not in live])
        except OSError:
            logger.warning("could not drop expired event logs", exc_info=True)
            return dropped
        dropped += len(batch) - len(live)
    return dropped


def exec_jobs_purge(*, now: datetime | None = None, batch_size: int = PURGE_BATCH) -> int:
    """Purge every finished job past its owner's retention (UserSettings.retention_days, else
    PTC_RETENTION_DAYS; neither: kept forever), ``batch_size`` jobs per transaction, and the
    standalone and managed containers' tool calls past it too, and the files of sessions that ended
    before it; first, the event logs that have expired (``event_logs_expire``: a folder of them it
    can't list or drop is logged, and the purge runs).

    Return how many jobs this run purged (0 when run again at once).

    It runs without PTC_DB_STATEMENT_TIMEOUT: a batch's calls are emptied in one statement (up to
    PURGE_BATCH jobs' calls, a thousand each), which on a busy deployment may take longer; cut off,
    the same batch would be tried, and cut off, at every round, and nothing purged again.
    """
    with statement_timeout_off():
        return _exec_jobs_purge(now=now, batch_size=batch_size)


def _exec_jobs_purge(*, now: datetime | None, batch_size: int) -> int:
    event_logs_expire()
    now = now or timezone.now()
    # Not while a call of it is still open: one a tools worker took before the job ended finishes
    # after it, and would write its output (and its events) back into the purged job.
    still_open = ToolCall.objects.filter(exec_job=OuterRef("pk"), status__in=ToolCall.OPEN)
    # Nor while a job is not closed yet: its worker (or the reaper) still writes to it, a cancelled
    # one what the code printed and wrote, and announces its end from it (a purge before would be
    # written over, for good, or announced purged).
    unclosed = Q(closed_at__isnull=True)
    unpurged = ExecJob.objects.filter(
        ~Exists(still_open), ~unclosed, status__in=ExecJob.FINISHED, purged_at__isnull=True, finished_at__isnull=False
    )
    # Calls no finished job carries, each purged on its own once past retention: standalone ones, and
    # a managed container's, whose job stays open for as long as its container calls (the reaper
    # closes it once idle: PTC_CONTAINER_IDLE_SECONDS), so the jobs' purge did not reach them.
    holding = (
        ToolCall.objects.filter(finished_at__isnull=False)
        .filter(Q(exec_job__isnull=True) | Q(exec_job__container_id__gt=""))
        .filter(~Q(input={}) | Q(output__isnull=False) | (Q(error__isnull=False) & ~Q(error__message=PURGED)))
    )
    containers: set[str] = set()
    purged = calls = files = 0
    for users, cutoff in _cutoffs(now=now):
        jobs = unpurged.filter(users, finished_at__lte=cutoff).order_by("finished_at")
        while ids := list(jobs.values_list("pk", flat=True)[:batch_size]):
            call_ids = _exec_jobs_purge_batch(ids=ids, now=now)
            if not call_ids:
                break  # all locked by a purge running beside this one: it will finish them
            purged += len(call_ids)
            # The job's live event log repeats its output and tool I/O: it goes too.
            try:
                backplane().events_drop(call_ids)
            except Exception:  # the log expires on its own (PTC_EVENTS_RETENTION_SECONDS)
                logger.warning("could not drop purged jobs' event logs", exc_info=True)
        standalone = holding.filter(users, finished_at__lte=cutoff).order_by("finished_at")
        while call_pks := list(standalone.values_list("pk", flat=True)[:batch_size]):
            batch = ToolCall.objects.filter(pk__in=call_pks)
            containers.update(batch.exclude(ptc_call_id="").values_list("ptc_call_id", flat=True))
            _container_bytes_freed(batch)
            calls += _tool_calls_empty(batch)
        # A session's files (uploaded to it, written by its jobs' code) are the session's, not a
        # job's: they go once it has ended (expired, lost) that long ago. Each round: a job that
        # ran as its session ended may write its files after.
        ended = ExecSession.objects.filter(users, ended_at__lte=cutoff)
        files += WorkFile.objects.filter(session__in=ended).delete()[0]
    if containers:  # their jobs' live event logs repeat those calls' inputs and outputs, and never expire
        try:
            backplane().events_drop(sorted(containers))
        except Exception:
            logger.warning("could not drop managed containers' event logs", exc_info=True)
    if purged or calls or files:
        logger.info("retention purged old jobs", extra={"jobs": purged, "standalone_calls": calls, "session_files": files})
    return purged
