"""Export to Anthropic's managed programmatic tool calling, where the provider's own code-execution
container runs the model's code and each tool call pauses it for the client to answer.

The provider's dated literals live here and nowhere else (PRODUCT.md, "Tool classification": the
core says ``code_execution``; an exporter maps it to the provider's current literal). The team's
loop answers each ``tool_use`` whose ``caller`` is the container by calling POST /api/v1/tools/execute
with that ``caller`` and the response's ``container.id``: ``routes`` says which toolset and tool a
name stands for.
"""

import json
from typing import Any

from tools.context import tool_names
from tools.models import Tool, Toolset

# The code-execution tool versions whose container may call our tools; the first is the default.
CODE_EXECUTION_VERSIONS = ("code_execution_20250825", "code_execution_20260120")
CODE_EXECUTION_NAME = "code_execution"


def managed_context(
    *, direct: list[tuple[Toolset, Tool]], per_toolset: list[tuple[Toolset, list[Tool]]], version: str | None
) -> dict[str, Any]:
    """Return ``tools`` (the code-execution tool, then every PTC tool with ``allowed_callers`` set to
    its version, then the direct tools as the model's own), ``routes``, an empty ``system_prompt``
    (the provider's container documents its tools itself) and ``stats``."""
    version = version or CODE_EXECUTION_VERSIONS[0]
    ptc = [(ts, t) for ts, tools in per_toolset for t in tools]
    every = ptc + direct
    names = tool_names(every)
    tools: list[dict[str, Any]] = [{"type": version, "name": CODE_EXECUTION_NAME}]
    for index, (name, (_, tool)) in enumerate(zip(names, every, strict=True)):
        entry = {"name": name, "description": tool.description, "input_schema": tool.input_schema or {"type": "object"}}
        if index < len(ptc):
            entry["allowed_callers"] = [version]
        tools.append(entry)
    routes = {name: {"toolset": ts.key, "tool": tool.name} for name, (ts, tool) in zip(names, every, strict=True)}
    chars = len(json.dumps(tools))
    return {"tools": tools, "routes": routes, "system_prompt": "", "stats": {"schema_chars": chars, "compact_chars": chars}}
