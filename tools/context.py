"""The prompt context of one agent turn (API.md, "The PTC decision and prompt context").

With PTC on, the model gets the direct tools with their full schemas, plus one ``exec_code`` tool
whose description is a compact reference: a line per PTC tool. The reference is as detailed as a
budget allows (``COMPACT_RATIO`` of the full schemas' size): a small toolset gets typed optional
parameters and a summary per tool; the GitHub MCP server's 114 tools get their required parameters
and a shorter summary, and ``ptc_tools.describe()`` has the rest. Every tool name and every required
parameter is always there. In discovery mode the reference holds tool names only.

Everything here is pure: it works on rows that are not saved (the context benchmark's).
"""

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.contrib.auth.models import User

from ptcproject.policy.selectors import policy_get, ptc_decision
from tools.client import client_tools_clean, client_toolset
from tools.models import Tool, Toolset
from tools.sdk import class_name, parameters, ptc_tools_of, sdk_hash_of, summary
from tools.selectors import toolset_keys_for_ptc, toolsets_named

EXEC_CODE = "exec_code"
# The provider's managed format (its own code-execution container runs the code): tools/anthropic_managed.py.
MANAGED_FORMAT = "anthropic-managed"
FORMATS = ("anthropic", "openai", MANAGED_FORMAT)
# The reference may cost this share of what the full schemas would, or MIN_BUDGET characters,
# whichever is more: for a handful of tools the fixed guidance alone is more than 10%.
COMPACT_RATIO = 0.10
MIN_BUDGET = 4000

_TERSE_TYPES = {
    "string": "",
    "integer": "int",
    "number": "num",
    "boolean": "bool",
    "array": "list",
    "object": "dict",
    "null": "None",
}
_FULL_TYPES = {
    "string": "str",
    "integer": "int",
    "number": "number",
    "boolean": "bool",
    "array": "list",
    "object": "dict",
    "null": "None",
}


@dataclass(frozen=True)
class Level:
    """How much one reference line says. ``optional``: ``typed``, ``names`` or ``ellipsis`` (``…``)."""

    terse_types: bool
    optional: str
    summary: int


# From most to least detailed; the first whose context fits the budget is used.
LEVELS = (
    Level(terse_types=False, optional="typed", summary=80),
    Level(terse_types=False, optional="typed", summary=40),
    Level(terse_types=True, optional="typed", summary=40),
    Level(terse_types=True, optional="names", summary=40),
    Level(terse_types=True, optional="names", summary=32),
    Level(terse_types=True, optional="ellipsis", summary=48),
    Level(terse_types=True, optional="ellipsis", summary=40),
    Level(terse_types=True, optional="ellipsis", summary=32),
    Level(terse_types=True, optional="ellipsis", summary=24),
    Level(terse_types=True, optional="ellipsis", summary=0),
)


# -- Provider formats ----------------------------------------------------------------------------
# Every tool in a context is one the model calls itself (``exec_code`` included: the runtime runs it
# here), so no ``allowed_callers`` is sent, and no provider's dated code-execution literal is needed.
def _anthropic(name: str, description: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "description": description, "input_schema": schema}


def _openai(name: str, description: str, schema: dict[str, Any]) -> dict[str, Any]:
    # The Responses API's function tool (Chat Completions nests the same under "function").
    return {"type": "function", "name": name, "description": description, "parameters": schema}


PROVIDERS: dict[str, Callable[[str, str, dict[str, Any]], dict[str, Any]]] = {"anthropic": _anthropic, "openai": _openai}


def tool_names(tools: list[tuple[Toolset, Tool]]) -> list[str]:
    """Return each tool's name in a provider's tool list: its own, or ``toolset__name`` where two
    requested toolsets share one."""
    counts: dict[str, int] = {}
    for _, tool in tools:
        counts[tool.name] = counts.get(tool.name, 0) + 1
    return [tool.name if counts[tool.name] == 1 else f"{toolset.key}__{tool.name}" for toolset, tool in tools]


def provider_tools(fmt: str, tools: list[tuple[Toolset, Tool]]) -> list[dict[str, Any]]:
    """Return ``tools`` in the provider's format, each with its full schema, named by ``tool_names``."""
    make = PROVIDERS[fmt]
    return [
        make(name, tool.description, tool.input_schema or {}) for name, (_, tool) in zip(tool_names(tools), tools, strict=True)
    ]


# -- The compact reference -----------------------------------------------------------------------
def _type(schema: Any, terse: bool) -> str:
    kinds = schema.get("type") if isinstance(schema, dict) else None
    names = _TERSE_TYPES if terse else _FULL_TYPES
    return names.get(kinds, "any" if terse else "Any") if isinstance(kinds, str) else ("any" if terse else "Any")


def _param(name: str, schema: Any, *, optional: bool, terse: bool) -> str:
    label = _type(schema, terse)
    return f"{name}{'?' if optional else ''}{f': {label}' if label else ''}"


def reference_line(toolset: Toolset, tool: Tool, level: Level) -> str:
    """Return one tool's line: ``name(required: type, optional?: type) -> returns - summary``."""
    required, optional, properties = parameters(tool.input_schema)
    params = [_param(n, properties[n], optional=False, terse=level.terse_types) for n in required]
    if level.optional == "typed":
        params += [_param(n, properties[n], optional=True, terse=level.terse_types) for n in optional]
    elif level.optional == "names":
        params += [f"{n}?" for n in optional]
    elif optional:
        params.append("…")
    returns = f" -> {_type(tool.output_schema, level.terse_types) or 'str'}" if tool.output_schema else ""
    text = summary(tool.description, level.summary) if level.summary else ""
    if text.endswith("…"):  # too long: say the same in fewer words before cutting it
        text = summary(_squeeze(tool.description, toolset), level.summary)
    return f"{tool.name}({', '.join(params)}){returns}{f' - {text}' if text else ''}"


_FILLER = frozenset({"a", "an", "the", "specific", "given"})


def _squeeze(description: str, toolset: Toolset) -> str:
    """Return ``description`` without words that say nothing in a one-line summary.

    Articles go, and the toolset's own name: under ``## ...github...``, "a GitHub repository" says
    no more than "repository".
    """
    redundant = _FILLER | {toolset.key.lower(), toolset.name.lower()}
    return " ".join(w for w in description.split(" ") if w.lower() not in redundant)


def _legend(level: Level) -> str:
    parts = ["? marks an optional parameter"]
    if level.terse_types:
        parts.append("a parameter without a type is a str")
    if level.optional == "names":
        parts.append('ptc_tools.describe("toolset.tool") gives the types')
    if level.optional == "ellipsis":
        parts.append('… stands for optional parameters: ptc_tools.describe("toolset.tool") lists them')
    return "; ".join(parts) + "."


def compact_reference(per_toolset: list[tuple[Toolset, list[Tool]]], level: Level) -> str:
    """Return the ``exec_code`` description: a line per PTC tool, grouped by toolset and by effect."""
    lines = ["Run Python 3 in a sandbox where these tools are functions. " + _legend(level)]
    for toolset, tools in per_toolset:
        if not tools:
            continue
        cls = class_name(toolset.key)
        lines.append(f"## from ptc_tools.{toolset.key} import {cls}; call {cls}.<tool>(...)")
        reads = [t for t in tools if t.read_only]
        writes = [t for t in tools if not t.read_only]
        if reads:
            lines.append("# read-only:")
            lines += [reference_line(toolset, t, level) for t in reads]
        if writes:
            lines.append("# with side effects:")
            lines += [reference_line(toolset, t, level) for t in writes]
    return "\n".join(lines)


def discovery_reference(per_toolset: list[tuple[Toolset, list[Tool]]]) -> str:
    """Return the ``exec_code`` description in discovery mode: toolset and tool names only."""
    lines = ["Run Python 3 in a sandbox where these tools are functions, by module and class:"]
    for toolset, tools in per_toolset:
        if tools:
            lines.append(f"{toolset.key}.{class_name(toolset.key)}: {', '.join(t.name for t in tools)}")
    return "\n".join(lines)


def system_prompt(per_toolset: list[tuple[Toolset, list[Tool]]], *, sequential: bool, discovery: bool) -> str:
    """Return the system-prompt partial: how to call the SDK, parallel or sequential, print little."""
    example = next(((ts, tools[0]) for ts, tools in per_toolset if tools), None)
    if example is None:
        how = "`from ptc_tools.<toolset> import <Toolset>`, then `<Toolset>.<tool>(name=value)`"
    else:
        ts, tool = example
        how = f"`from ptc_tools.{ts.key} import {class_name(ts.key)}`, then `{class_name(ts.key)}.{tool.name}(...)`"
    lines = [
        f"## Tools in code: `{EXEC_CODE}`",
        f"Call `{EXEC_CODE}` with Python 3. Toolsets are modules and tools are functions taking keyword arguments: {how}.",
        "A failed call raises `ptc_tools.ToolError` (`.code`, `.message`); catch it to carry on.",
    ]
    if discovery:
        lines.append(
            'Read a tool\'s docs first: `print(ptc_tools.describe("toolset.tool"))`; find tools: `ptc_tools.search("words")`.'
        )
    if sequential:
        lines.append("Make every tool call one at a time: no thread pools, no `asyncio.gather`.")
    else:
        lines.append(
            "Read-only tools may run in parallel (a thread pool, or `asyncio.gather` over `await Toolset.tool.aio(...)`); "
            "run tools with side effects one at a time."
        )
    lines.append("Print only what matters: only printed output and the last expression's value come back to you.")
    return "\n".join(lines)


def _exec_code_tool(fmt: str, description: str) -> dict[str, Any]:
    schema = {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "Python source. The last expression's value is returned."}},
        "required": ["code"],
    }
    return PROVIDERS[fmt](EXEC_CODE, description, schema)


def _chars(tools: list[dict[str, Any]], prompt: str = "") -> int:
    # What a provider's request carries: the tool list as JSON, plus the system prompt's text.
    return len(json.dumps(tools)) + len(prompt)


def ptc_context_build(
    *,
    fmt: str,
    enabled: bool,
    sequential: bool,
    discovery: bool,
    direct: list[tuple[Toolset, Tool]],
    per_toolset: list[tuple[Toolset, list[Tool]]],
    levels: tuple[Level, ...] = LEVELS,
) -> dict[str, Any]:
    """Return ``tools``, ``system_prompt`` and ``stats`` for a turn.

    ``direct`` are the direct tools, ``per_toolset`` the PTC tools (as ``ptc_tools_of`` gives them).
    With PTC off, ``tools`` is every tool with its full schema and there is no ``exec_code``.
    """
    every = provider_tools(fmt, direct + [(ts, t) for ts, tools in per_toolset for t in tools])
    schema_chars = _chars(every)
    if not enabled:
        return {"tools": every, "system_prompt": "", "stats": {"schema_chars": schema_chars, "compact_chars": schema_chars}}
    direct_tools = provider_tools(fmt, direct)
    prompt = system_prompt(per_toolset, sequential=sequential, discovery=discovery)
    if discovery:
        tools = [*direct_tools, _exec_code_tool(fmt, discovery_reference(per_toolset))]
    else:
        budget = max(COMPACT_RATIO * schema_chars, MIN_BUDGET)
        for level in levels:
            tools = [*direct_tools, _exec_code_tool(fmt, compact_reference(per_toolset, level))]
            if _chars(tools, prompt) <= budget:
                break
    return {
        "tools": tools,
        "system_prompt": prompt,
        "stats": {"schema_chars": schema_chars, "compact_chars": _chars(tools, prompt)},
    }


def tools_split(
    *, toolsets: list[Toolset], direct_only: frozenset[str]
) -> tuple[list[tuple[Toolset, Tool]], list[tuple[Toolset, list[Tool]]]]:
    """Return the toolsets' enabled direct tools, and their PTC tools per toolset (``ptc_tools_of``)."""
    per_toolset = ptc_tools_of(toolsets, direct_only)
    ptc = {t.pk for _, tools in per_toolset for t in tools}
    direct = [(ts, t) for ts in sorted(toolsets, key=lambda t: t.key) for t in ts.tools.all() if t.enabled and t.pk not in ptc]
    return direct, per_toolset


def ptc_context(
    *,
    user: User,
    keys: list[str] | None,
    title: str,
    fmt: str,
    discovery: bool,
    client_tools: list[dict[str, Any]] | None = None,
    code_execution_version: str | None = None,
) -> dict[str, Any]:
    """Return the prompt context of a turn (API.md): the policy's decision, the tools, the prompt, stats.

    ``keys`` None means every toolset the user may use with PTC. ``client_tools`` are the job's own
    (``ptc_tools.client``), in the reference like any toolset's. Raise ApplicationError for unknown
    keys or invalid client tools.

    ``fmt`` ``anthropic-managed`` exports the PTC tools for the provider's own code-execution container
    instead (tools/anthropic_managed.py): no ``exec_code``; ``routes`` maps each tool's name back to its
    toolset and tool, for POST /tools/execute.
    """
    client = client_tools_clean(client_tools or [])
    policy = policy_get()
    if keys is None:
        keys = toolset_keys_for_ptc(user=user, allowlist=policy.toolset_allowlist, blocklist=policy.toolset_blocklist)
    toolsets = toolsets_named(user=user, keys=keys)
    decision = ptc_decision(policy=policy, user=user, toolsets=[ts.key for ts in toolsets], title=title)
    direct, per_toolset = tools_split(toolsets=toolsets, direct_only=frozenset(policy.direct_only_tools))
    if client:
        per_toolset.append(client_toolset(client))
    if fmt == MANAGED_FORMAT:
        from tools.anthropic_managed import managed_context  # it builds on this module's naming

        built = managed_context(direct=direct, per_toolset=per_toolset, version=code_execution_version)
        return {
            "ptc_enabled": decision.enabled,
            "reason": decision.reason,
            "sequential": policy.sequential,
            "sdk_hash": sdk_hash_of(per_toolset),
            **built,
        }
    built = ptc_context_build(
        fmt=fmt,
        enabled=decision.enabled,
        sequential=policy.sequential,
        discovery=discovery,
        direct=direct,
        per_toolset=per_toolset,
    )
    return {
        "ptc_enabled": decision.enabled,
        "reason": decision.reason,
        "sequential": policy.sequential,
        "sdk_hash": sdk_hash_of(per_toolset),
        **built,
    }
