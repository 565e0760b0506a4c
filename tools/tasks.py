from typing import Any

from celery import shared_task
from celery.signals import worker_process_shutdown, worker_ready, worker_shutdown
from django.conf import settings
from django.db import InterfaceError, OperationalError

from execution.services import tool_call_abort, tool_call_execute, tool_calls_heartbeat
from ptcproject import queues
from ptcproject.periodic import run_every
from tools.kinds import mcp


# No soft or hard time limit: the threads pool can't enforce them. Each kind holds a call to its
# tool's timeout (builtin: a watched thread; http: httpx's; mcp: the session's read timeout).
@shared_task(
    queue=queues.TOOLS,
    acks_late=True,
    # Only a database that is briefly unreachable is worth a retry; the claim makes a retry safe.
    autoretry_for=(OperationalError, InterfaceError),
    retry_backoff=True,
    max_retries=3,
)
def execute_tool(call_id: str) -> None:
    try:
        tool_call_execute(call_id=call_id)
    except (OperationalError, InterfaceError):
        raise
    except Exception:
        # A bug must not leave the code waiting for a result that never comes: fail the call now.
        tool_call_abort(call_id=call_id)
        raise


@worker_ready.connect
def _renew_call_leases(sender: Any = None, **_: Any) -> None:
    """A tools worker renews the lease of every call it runs; when it dies, the reaper fails them
    as ``worker_lost`` once the lease lapses."""
    consumer_queues = {q.name for q in getattr(getattr(sender, "task_consumer", None), "queues", [])}
    if not consumer_queues or queues.TOOLS in consumer_queues:
        run_every("ptc-call-leases", settings.PTC_JOB_HEARTBEAT_SECONDS, tool_calls_heartbeat)


@worker_shutdown.connect
@worker_process_shutdown.connect
def _close_mcp_sessions(**_: Any) -> None:
    # A tools worker holds one session per MCP toolset, and a stdio server process behind each:
    # stop them with the worker, not with the interpreter (atexit backs this up).
    mcp.sessions_close()
