"""Builtin toolsets: Python callables shipped in the code base, registered here by key."""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class BuiltinTool:
    name: str
    func: Callable[..., Any]
    description: str
    input_schema: dict[str, Any]
    output_schema: dict[str, Any] | None = None
    read_only: bool = True
    price: int | None = None
    billing_free: bool = False
    # Set by a builtin whose name collides with a lifecycle tool in ``direct_only_tools`` but
    # which is meant to be called from code (``demo.fail``): its code owner knows it is not one.
    callable_from_code: bool = False


@dataclass(frozen=True)
class BuiltinToolset:
    key: str
    name: str
    description: str
    price: int = 0
    billing_free: bool = False
    tools: list[BuiltinTool] = field(default_factory=list)


def registry() -> dict[str, BuiltinToolset]:
    """Return every builtin toolset by key."""
    from tools.builtin import demo

    return {ts.key: ts for ts in (demo.TOOLSET,)}


def builtin_callable_from_code(toolset_key: str, tool_name: str) -> bool:
    """Return True if the builtin ``toolset_key.tool_name`` declares itself callable from code."""
    spec = registry().get(toolset_key)
    return bool(spec and any(t.name == tool_name and t.callable_from_code for t in spec.tools))
