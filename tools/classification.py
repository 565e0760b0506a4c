"""Which tools are callable from code (PTC) and which are direct (PRODUCT.md, "Tool classification")."""

from ptcproject.policy.selectors import policy_get
from tools.builtin import builtin_callable_from_code
from tools.models import Tool, Toolset


def direct_only_tools() -> frozenset[str]:
    """Return the tool names that are always direct: the policy's ``direct_only_tools``, read fresh."""
    return frozenset(policy_get().direct_only_tools)


def tool_is_ptc(*, tool: Tool, toolset: Toolset, direct_only: frozenset[str]) -> bool:
    """Return True if ``tool`` is callable from code (PRODUCT.md, "Tool classification").

    MCP tools are always PTC. Otherwise a tool is direct when its name is direct-only, or when
    its ``allowed_callers`` is set and lacks ``code_execution``. A builtin may declare in code that
    a direct-only name of its own is not the lifecycle tool (``demo.fail``).
    """
    if toolset.kind == Toolset.Kind.MCP:
        return True
    if tool.name in direct_only and not (
        toolset.kind == Toolset.Kind.BUILTIN and builtin_callable_from_code(toolset.key, tool.name)
    ):
        return False
    callers = tool.allowed_callers or [Tool.Caller.CODE_EXECUTION]
    return Tool.Caller.CODE_EXECUTION in callers
