from typing import Any

from celery import shared_task
from celery.signals import worker_process_shutdown, worker_shutdown
from django.db import OperationalError

from execution.services import tool_call_abort, tool_call_execute
from ptcproject import queues
from tools.kinds import mcp


@shared_task(
    queue=queues.TOOLS,
    acks_late=True,
    soft_time_limit=300,
    time_limit=330,
    # Only a database that is briefly unreachable is worth a retry; the claim makes a retry safe.
    autoretry_for=(OperationalError,),
    retry_backoff=True,
    max_retries=3,
)
def execute_tool(call_id: str) -> None:
    try:
        tool_call_execute(call_id=call_id)
    except OperationalError:
        raise
    except Exception:
        # A bug must not leave the code waiting for a result that never comes: fail the call now.
        tool_call_abort(call_id=call_id)
        raise


@worker_shutdown.connect
@worker_process_shutdown.connect
def _close_mcp_sessions(**_: Any) -> None:
    # A tools worker holds one session per MCP toolset, and a stdio server process behind each:
    # stop them with the worker, not with the interpreter (atexit backs this up).
    mcp.sessions_close()
