from django.contrib.auth.models import User
from django.db.models import Prefetch, QuerySet

from execution.models import ExecJob, ToolCall
from tools.client import CLIENT_KEY
from tools.models import Toolset


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


def tool_call_is_client(call: ToolCall) -> bool:
    """Return True if ``call`` is of a client tool (its caller runs it): a job's own (no tool row,
    toolset ``client``) or a ``client`` toolset's. Reads ``call.tool.toolset``: select it with the call."""
    if call.tool_id is None:
        return call.toolset_key == CLIENT_KEY
    return call.tool is not None and call.tool.toolset.kind == Toolset.Kind.CLIENT
