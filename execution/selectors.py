from django.contrib.auth.models import User
from django.db.models import Prefetch, QuerySet

from execution.models import ExecJob, ToolCall


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
