"""Rows the tests make directly, when a test is about what a worker does with them."""

import uuid
from collections.abc import Iterable
from typing import Any

from django.contrib.auth.models import AbstractBaseUser
from django.db import connection
from django.utils import timezone

from execution.models import ExecJob, ToolCall
from tools.models import Tool


def running_job(*, user: AbstractBaseUser, **fields: Any) -> ExecJob:
    """A job as a worker runs it, or with ``status`` as it ended: one that ended with a time to it is
    closed then (as its worker closes it; left unclosed, the stack's reaper would close it), unless
    ``closed_at`` says otherwise."""
    if fields.get("status", "running") in ExecJob.FINISHED and fields.get("finished_at"):
        fields = {"closed_at": fields["finished_at"], **fields}
    return ExecJob.objects.create(
        **{"user": user, "code": "", "toolsets": ["demo"], "timeout_seconds": 30, "status": "running", **fields}
    )


def demo_call(*, user: AbstractBaseUser, job: ExecJob | None = None, tool: str = "add", **fields: Any) -> ToolCall:
    """A call of the demo toolset's ``tool`` as a bridge would have recorded it: executing, unclaimed."""
    values: dict[str, Any] = {
        "call_id": f"ptc_{uuid.uuid4().hex}",
        "type": "ptc" if job else "standalone",
        "exec_job": job,
        "ptc_call_id": job.call_id if job else "",
        "user": user,
        "toolset_key": "demo",
        "tool_name": tool,
        "tool": Tool.objects.select_related("toolset").get(toolset__key="demo", toolset__owner=None, name=tool),
        "input": {"a": 1, "b": 2},
        "started_at": timezone.now(),
    }
    return ToolCall.objects.create(**{**values, **fields})


def job_calls(job: ExecJob, rows: Iterable[dict[str, Any]]) -> list[ToolCall]:
    """Calls of ``job``, one per row of fields, made in one bulk_create: its user's, of the demo
    toolset, completed, a credit each, unless a row says otherwise. For a test about reading many."""
    base = {"type": "ptc", "exec_job": job, "ptc_call_id": job.call_id, "user_id": job.user_id}
    base |= {"toolset_key": "demo", "status": "completed", "credits": 1}
    return ToolCall.objects.bulk_create(ToolCall(call_id=f"ptc_{uuid.uuid4().hex}", **{**base, **row}) for row in rows)


def finished_calls(*, user: AbstractBaseUser, rows: int) -> None:
    """``rows`` completed standalone calls of ``user``'s, in one statement (a list at scale)."""
    with connection.cursor() as cursor:
        cursor.execute(
            """
            INSERT INTO execution_toolcall (call_id, type, ptc_call_id, user_id, toolset_key, tool_name, input, status,
                                            credits, started_at, finished_at, decision, decision_reason)
            SELECT 'standalone_' || md5(random()::text || g), 'standalone', '', %s, 'demo', 'add', '{}'::jsonb,
                   'completed', 0, now(), now(), '', ''
            FROM generate_series(1, %s) g
            """,
            [user.pk, rows],
        )
