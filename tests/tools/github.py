"""The GitHub MCP server's real tool list (MIT; its source is named inside): a large toolset for the
tests and the benchmarks."""

import json
from pathlib import Path
from typing import Any

GITHUB_TOOLS = Path(__file__).resolve().parent / "data" / "github-mcp-tools.json"


def github_tools() -> list[dict[str, Any]]:
    """The server's tools as it lists them (MCP's ``tools/list``)."""
    return list(json.loads(GITHUB_TOOLS.read_text())["tools"])


def github_toolset(key: str) -> dict[str, Any]:
    """The body of ``POST /api/v1/toolsets`` for an mcp toolset ``key`` with the server's tools (its
    server is never started)."""
    return {
        "key": key,
        "name": "GitHub",
        "kind": "mcp",
        "config": {"transport": "stdio", "command": "github-mcp-server", "args": ["stdio"]},
        "tools": [
            {
                "name": t["name"],
                "description": t["description"],
                "input_schema": t["inputSchema"],
                "read_only": bool(t.get("annotations", {}).get("readOnlyHint")),
            }
            for t in github_tools()
        ],
    }
