"""Fixtures for the catalog tests: a staff client, toolsets made through the API, child processes."""

import os
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Api

HERE = Path(__file__).resolve().parent
MCP_SERVER = str(HERE / "mcp_server.py")
BAD_MCP_SERVER = str(HERE / "bad_mcp_server.py")


def unique_key(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:8]}"


def private_http_toolset(key: str, name: str, tools: list[dict[str, Any]]) -> dict[str, Any]:
    """The body of ``POST /api/v1/toolsets`` for an http toolset of the staff member's own (no other
    test sees it), whose server never answers."""
    return {
        "key": key,
        "name": name,
        "kind": "http",
        "is_global": False,
        "config": {"base_url": "http://127.0.0.1:9", "timeout": 1},
        "tools": tools,
    }


def children(pid: int) -> list[tuple[int, str]]:
    """Return the live (pid, command line) of ``pid``'s child processes, from /proc."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append((int(entry), cmdline))
    return found


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture
def create_toolset(staff: Api) -> Iterator[Callable[..., dict[str, Any]]]:
    """Create toolsets through the staff API (asserting 201); delete them at the end of the test."""
    made: list[str] = []

    def create(body: dict[str, Any]) -> dict[str, Any]:
        response = staff.post("/api/v1/toolsets", json=body)
        assert response.status_code == 201, response.text
        made.append(body["key"])
        return response.json()

    yield create
    for key in made:
        staff.http.delete(f"/api/v1/toolsets/{key}")


def mcp_stdio_config(marker: str, script: str = MCP_SERVER, *args: str, **env: str) -> dict[str, Any]:
    """Return the config of a stdio MCP toolset running ``script``, tagged with ``marker``."""
    return {"transport": "stdio", "command": sys.executable, "args": [script, *args, f"--marker={marker}"], "env": env}
