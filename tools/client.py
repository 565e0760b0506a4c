"""A job's own client tools (``POST /exec`` ``client_tools``): tools its caller runs.

They are checked like a ``client`` toolset's tools, then live on the job as JSON. The SDK, the
prompt context and the call checker see them as one unsaved toolset, ``client`` (``from
ptc_tools.client import Client``), of kind ``client``: no runner here, a call waits on the caller.
"""

import json
from typing import Any

from django.conf import settings

from ptcproject.errors import ApplicationError
from tools.models import Tool, Toolset
from tools.validation import tool_errors

# The module and toolset key of a job's own client tools.
CLIENT_KEY = "client"


def client_tools_clean(definitions: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Return the job's client tool definitions, normalised: ``{name, description, input_schema,
    output_schema, timeout}``. Raise ApplicationError ``validation_error`` (400): too many or too
    large, or else naming every problem: a bad name or schema, a duplicate."""
    problems: dict[str, list[str]] = {}
    if len(definitions) > settings.PTC_MAX_CLIENT_TOOLS:
        problems["client_tools"] = [f"at most {settings.PTC_MAX_CLIENT_TOOLS} client tools per job"]
    size = len(json.dumps(definitions))
    if size > settings.PTC_MAX_CLIENT_TOOLS_BYTES:
        problems.setdefault("client_tools", []).append(
            f"the definitions are {size} bytes of JSON; the limit is {settings.PTC_MAX_CLIENT_TOOLS_BYTES}"
        )
    if problems:
        # Refused for that alone: each definition's name and schema checked too, 10,000 of them
        # (a body's worth) held the web process for seconds.
        raise ApplicationError("validation_error", "The client_tools are over their limits; see details.", details=problems)
    cleaned, seen = [], set()
    for i, definition in enumerate(definitions):
        schema = definition.get("input_schema") or {"type": "object", "properties": {}}
        tool = {
            "name": definition.get("name"),
            "description": definition.get("description") or "",
            "input_schema": schema,
            "output_schema": definition.get("output_schema"),
            "timeout": definition.get("timeout"),
        }
        for error in tool_errors(tool, kind=Toolset.Kind.CLIENT, path=f"client_tools[{i}]"):
            problems.setdefault(error.path, []).append(error.message)
        if tool["name"] in seen:
            problems.setdefault(f"client_tools[{i}].name", []).append(f"'{tool['name']}' is defined twice")
        seen.add(tool["name"])
        cleaned.append(tool)
    if problems:
        raise ApplicationError("validation_error", "The client_tools are invalid; details names each problem.", details=problems)
    return cleaned


def client_toolset(definitions: list[dict[str, Any]]) -> tuple[Toolset, list[Tool]]:
    """Return a job's client tools as an unsaved ``client`` toolset and its tools, by name."""
    toolset = Toolset(
        key=CLIENT_KEY,
        name="Client tools",
        description="Tools your caller runs: a call waits until the caller posts its result.",
        kind=Toolset.Kind.CLIENT,
        is_global=False,
        billing_free=True,
    )
    tools = [
        Tool(
            toolset=toolset,
            name=d["name"],
            description=d.get("description") or "",
            input_schema=d.get("input_schema") or {"type": "object", "properties": {}},
            output_schema=d.get("output_schema"),
            timeout=d.get("timeout"),
            billing_free=True,
        )
        for d in definitions
    ]
    return toolset, sorted(tools, key=lambda t: t.name)


def is_job_client_tool(tool: Tool) -> bool:
    """Return True for a job's own client tool (an unsaved row), False for a saved tool."""
    return tool._state.adding and tool.toolset.kind == Toolset.Kind.CLIENT
