import logging

from django.contrib.auth.models import User
from django.db.models import Prefetch, QuerySet

from execution.models import ExecJob, ToolCall

logger = logging.getLogger("ptc.execution")


def exec_jobs_for(*, user: User) -> QuerySet[ExecJob]:
    """Return the jobs ``user`` may see: their own, or all of them for staff."""
    jobs = ExecJob.objects.all()
    if not user.is_staff:
        jobs = jobs.filter(user=user)
    return jobs.prefetch_related(Prefetch("tool_calls", queryset=ToolCall.objects.order_by("started_at", "id")))


def tool_calls_for(*, user: User) -> QuerySet[ToolCall]:
    """Return the tool calls ``user`` may see, in start order."""
    calls = ToolCall.objects.all()
    if not user.is_staff:
        calls = calls.filter(user=user)
    return calls.order_by("started_at", "id")


def exec_job_wait(*, job: ExecJob, seconds: float) -> None:
    """Block until ``job`` has finished or ``seconds`` pass. Woken by the job's end, never polled;
    no database connection is held while it waits. If the backplane can't be reached, it returns
    at once: the caller shows the job as it is."""
    from execution.backplane import End, backplane, job_channel

    if seconds <= 0:
        return
    try:
        backplane().wait_for(
            job_channel(job.call_id),
            done=lambda: ExecJob.objects.filter(pk=job.pk, status__in=ExecJob.FINISHED).exists(),
            match=lambda message: isinstance(message, End),
            timeout=seconds,
        )
    except Exception:  # no push to wait for; the job is shown as it is now
        logger.warning("cannot wait for a job: its channel is unreachable", exc_info=True)
