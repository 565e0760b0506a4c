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
