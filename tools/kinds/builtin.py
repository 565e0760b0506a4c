import logging
from typing import Any

from tools.builtin import registry
from tools.errors import ToolFailure
from tools.models import Tool, Toolset

logger = logging.getLogger("ptc.tools")


def run(*, toolset: Toolset, tool: Tool, arguments: dict[str, Any], timeout: float) -> Any:
    """Call the builtin's Python function. The arguments were validated against its schema."""
    spec = registry().get(toolset.key)
    func = next((t.func for t in spec.tools if t.name == tool.name), None) if spec else None
    if func is None:
        raise ToolFailure("tool_not_found", f"Builtin tool '{toolset.key}.{tool.name}' is not in this server's code.")
    try:
        return func(**arguments)
    except ToolFailure:
        raise
    except Exception as exc:  # a builtin's bug is the call's failure, never the worker's
        logger.exception("builtin tool %s.%s raised", toolset.key, tool.name)
        raise ToolFailure("tool_exception", f"{type(exc).__name__}: {exc}") from exc
