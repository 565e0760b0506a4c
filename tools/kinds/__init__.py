"""How each kind of toolset runs one call. Each kind exposes ``run(toolset, tool, arguments, timeout)``."""

from typing import Any, Protocol

from tools.errors import ToolFailure
from tools.kinds import builtin, http, mcp
from tools.models import Tool, Toolset


class _Runner(Protocol):
    def __call__(self, *, toolset: Toolset, tool: Tool, arguments: dict[str, Any], timeout: float) -> Any: ...


# Keyed by str: ``toolset.kind`` is the column's text, which may name a kind this server can't run.
_RUNNERS: dict[str, _Runner] = {Toolset.Kind.BUILTIN: builtin.run, Toolset.Kind.HTTP: http.run, Toolset.Kind.MCP: mcp.run}


def tool_run(*, toolset: Toolset, tool: Tool, arguments: dict[str, Any], timeout: float) -> Any:
    """Run one call and return its JSON-able output, or raise ``ToolFailure``."""
    runner = _RUNNERS.get(toolset.kind)
    if runner is None:
        raise ToolFailure(
            "kind_unsupported", f"Toolset '{toolset.key}' is of kind '{toolset.kind}', which this server cannot run."
        )
    return runner(toolset=toolset, tool=tool, arguments=arguments, timeout=timeout)
