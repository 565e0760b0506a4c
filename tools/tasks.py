"""A tools worker's lifecycle on the tools side. (Its task, execute_tool, lives in execution.tasks,
beside the service it runs.)"""

from typing import Any

from celery.signals import worker_process_shutdown, worker_shutdown

from tools.kinds import mcp


@worker_shutdown.connect
@worker_process_shutdown.connect
def _close_mcp_sessions(**_: Any) -> None:
    # A tools worker holds one session per MCP toolset, and a stdio server process behind each:
    # stop them with the worker, not with the interpreter (atexit backs this up).
    mcp.sessions_close()
