from datetime import datetime, timedelta
from typing import Any

from django.contrib.auth.models import User
from django.db.models import Count, Exists, Max, OuterRef, Prefetch, Q, QuerySet, Subquery
from django.db.models.functions import Coalesce
from django.utils import timezone

from execution.models import ExecJob, ExecSession, ToolCall, WorkFile
from execution.sandbox.limits import CALL_GRACE_SECONDS
from tools.client import CLIENT_KEY
from tools.models import Toolset
from tools.selectors import tool_timeout_or_default

# A job's calls as the API lists them: in start order.
CALLS_IN_ORDER = Prefetch("tool_calls", queryset=ToolCall.objects.order_by("started_at", "id"))


def _with_calls(jobs: QuerySet[ExecJob]) -> QuerySet[ExecJob]:
    return jobs.prefetch_related(CALLS_IN_ORDER)


def exec_jobs_visible(*, user: User) -> QuerySet[ExecJob]:
    """Return the jobs ``user`` may see (their own, or all of them for staff), without their calls:
    for a view that acts on a job rather than shows it, which would read every call's input and
    output for nothing."""
    jobs = ExecJob.objects.all()
    return jobs if user.is_staff else jobs.filter(user=user)


def exec_jobs_for(*, user: User) -> QuerySet[ExecJob]:
    """Return the jobs ``user`` may see, each with its calls: what the API shows of a job."""
    return _with_calls(exec_jobs_visible(user=user))


def exec_job_with_calls(*, job_id: Any) -> ExecJob:
    """Return the job with its user and its calls in start order: all the API shows of it."""
    return _with_calls(ExecJob.objects.select_related("user")).get(pk=job_id)


def tool_calls_for(*, user: User) -> QuerySet[ToolCall]:
    """Return the tool calls ``user`` may see, in start order."""
    calls = ToolCall.objects.all()
    if not user.is_staff:
        calls = calls.filter(user=user)
    return calls.order_by("started_at", "id")


def tool_call_is_client(call: ToolCall) -> bool:
    """Return True if ``call`` is of a client tool (its caller runs it): a job's own (no tool row,
    toolset ``client``) or a ``client`` toolset's. Reads ``call.tool.toolset``: select it with the call."""
    if call.tool_id is None:
        return call.toolset_key == CLIENT_KEY
    return call.tool is not None and call.tool.toolset.kind == Toolset.Kind.CLIENT


def sessions_for(*, user: User) -> QuerySet[ExecSession]:
    """Return the sessions ``user`` may see: only their own, staff too (a session is one user's
    sandbox; the admin site shows them all)."""
    return ExecSession.objects.filter(user=user)


def sessions_in_state(sessions: QuerySet[ExecSession], status: str) -> QuerySet[ExecSession]:
    """Return those of ``sessions`` whose status is ``status`` as of now, as ``ExecSession.state``
    tells it: one past its time that the reaper has not recorded yet is expired, not active."""
    past = Q(status=ExecSession.Status.ACTIVE, expires_at__lte=timezone.now())
    if status == ExecSession.Status.ACTIVE:
        return sessions.filter(status=status).exclude(past)
    if status == ExecSession.Status.EXPIRED:
        return sessions.filter(Q(status=status) | past)
    return sessions.filter(status=status)


def work_files_of(*, session: ExecSession | None = None, job: ExecJob | None = None) -> QuerySet[WorkFile]:
    """Return a session's files, or a job's output files, by path, without their contents."""
    if session is not None:
        files = WorkFile.objects.filter(session=session)
    else:
        files = WorkFile.objects.filter(exec_job=job, kind=WorkFile.Kind.OUTPUT)
    return files.defer("content").order_by("path")


def calls_overdue_at(calls: QuerySet[ToolCall]) -> datetime | None:
    """Return when the last of ``calls`` is overdue: its claim (or its start), plus its tool's
    timeout, plus CALL_GRACE_SECONDS, the deadline the bridge gives a call; None if there are none."""
    ends = [
        (claimed_at or started_at) + timedelta(seconds=tool_timeout_or_default(timeout) + CALL_GRACE_SECONDS)
        for claimed_at, started_at, timeout in calls.values_list("claimed_at", "started_at", "tool__timeout")
    ]
    return max(ends, default=None)


def container_jobs_open(*, user: User | None = None) -> QuerySet[ExecJob]:
    """Return the managed containers' jobs still open (``running``), of ``user`` if given."""
    jobs = ExecJob.objects.exclude(container_id="").filter(status=ExecJob.Status.RUNNING)
    return jobs if user is None else jobs.filter(user=user)


def _last_used_at() -> Coalesce:
    """A managed container's job's last use: ``last_call_at``; for a job made before it was kept,
    when its last call started or ended (read only for such a job: PostgreSQL evaluates a
    COALESCE's arguments only as far as the first not null), or its start."""
    last_call = (
        ToolCall.objects.filter(exec_job=OuterRef("pk"))
        .values("exec_job")
        .annotate(last=Max(Coalesce("finished_at", "started_at")))
        .values("last")
    )
    return Coalesce("last_call_at", Subquery(last_call), "started_at")


def _call_open() -> Exists:
    """Whether a call of the job is still open."""
    return Exists(ToolCall.objects.filter(exec_job=OuterRef("pk"), status__in=ToolCall.OPEN))


def container_jobs_idle(*, since: datetime) -> QuerySet[ExecJob]:
    """Return the managed containers' jobs open whose ``last_call_at`` is before ``since``, or not
    known (made before it was kept): those the reaper may close (PTC_CONTAINER_IDLE_SECONDS), once
    their calls confirm it (``container_job_calls_last``). Their calls are not read here: this
    runs every reaper round, over every open container's job."""
    return container_jobs_open().filter(Q(last_call_at__lt=since) | Q(last_call_at__isnull=True))


def container_job_calls_last(*, job_id: Any) -> tuple[datetime | None, bool]:
    """Return when the last call of a job started or ended (None if it has none), and whether one
    is still open, from its calls, in one statement: the reaper's word before it closes the job."""
    found = ToolCall.objects.filter(exec_job_id=job_id).aggregate(
        last=Max(Coalesce("finished_at", "started_at")), open=Count("pk", filter=Q(status__in=ToolCall.OPEN))
    )
    return found["last"], bool(found["open"])


def container_jobs_idle_since(*, user: User, container_id: str) -> datetime | None:
    """Return when the managed container's job of ``user`` unused longest (no call open; other than
    ``container_id``'s) was last used: the first the reaper will close. None if each has a call open."""
    jobs = container_jobs_open(user=user).exclude(container_id=container_id).filter(~_call_open())
    return jobs.annotate(last_used_at=_last_used_at()).order_by("last_used_at").values_list("last_used_at", flat=True).first()
