"""The mcp kind, against real MCP servers started by the tests (tests/tools/mcp_server.py), over stdio
and streamable HTTP: sync, calls from code, pooled sessions that never leak a server process, and
servers that fail to start, hang, or talk garbage."""

import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from execution.models import ToolCall
from tests.conftest import Api
from tests.stack import Process, Stack, free_port
from tests.tools.conftest import BAD_MCP_SERVER, MCP_SERVER, alive, children, mcp_stdio_config, unique_key
from tools.errors import ToolFailure
from tools.kinds import mcp
from tools.models import Tool, Toolset
from tools.sdk import class_name

TOKEN = f"tok-{uuid.uuid4().hex}"


def _servers(pid: int, marker: str) -> list[int]:
    return [child for child, cmdline in children(pid) if f"--marker={marker}" in cmdline]


def _wait_for(predicate: Callable[[], bool], seconds: float = 15) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


@pytest.fixture
def stdio_toolset(staff: Api, create_toolset: Callable[..., dict[str, Any]]) -> tuple[str, str]:
    """An MCP toolset on a stdio server, synced; return its key and the marker of its processes."""
    key, marker = unique_key("mcp"), uuid.uuid4().hex
    create_toolset(
        {
            "key": key,
            "name": "Test MCP",
            "kind": "mcp",
            "config": mcp_stdio_config(marker, TOKEN="{{secrets.TOKEN}}", EXTRA_TOOL="1"),
            "secrets": {"TOKEN": TOKEN},
        }
    )
    sync = staff.post(f"/api/v1/toolsets/{key}/sync")
    assert sync.status_code == 200, sync.text
    return key, marker


def test_sync_lists_the_servers_tools(staff: Api, stdio_toolset: tuple[str, str]) -> None:
    key, _ = stdio_toolset
    toolset = staff.get(f"/api/v1/toolsets/{key}").json()
    tools = {t["name"]: t for t in toolset["tools"]}
    assert set(tools) == {"add", "weather", "boom", "whoami", "refused", "configured", "get_thing", "slow", "extra"}
    # What the server lists is shown to everyone the toolset is granted to: never its secrets.
    assert TOKEN not in json.dumps(toolset)
    assert tools["configured"]["description"] == "Lists with its own configuration quoted: token [redacted]."
    assert tools["configured"]["input_schema"]["properties"]["endpoint"]["default"] == "https://api.example/?key=[redacted]"
    assert tools["add"]["read_only"] is True and tools["boom"]["read_only"] is False
    assert tools["add"]["description"] == "Add two integers."
    assert tools["add"]["signature"] == "add(a: int, b: int) -> dict"
    assert tools["weather"]["output_schema"]["properties"]["celsius"] == {"title": "Celsius", "type": "number"}
    assert all(t["ptc"] for t in tools.values())  # MCP tools are always PTC tools
    # A name Python can't spell gets one it can; calls use the server's own.
    assert Tool.objects.get(toolset__key=key, name="get_thing").remote_name == "get-thing"
    again = staff.post(f"/api/v1/toolsets/{key}/sync").json()
    assert again["added"] == [] and again["updated"] == [] and again["disabled"] == []
    assert toolset["config"] is not None and again["toolset"]["config"] == toolset["config"]  # staff see it in both


def test_calls_from_code(api: Api, stdio_toolset: tuple[str, str]) -> None:
    key, _ = stdio_toolset
    code = f"""
from ptc_tools import ToolError
from ptc_tools.{key} import {class_name(key)} as M
print(M.add(a=2, b=3))
print(M.weather(city="Lima"))
print(M.whoami())
print(M.get_thing(thing_id="7"))
try:
    M.boom(message="kaput")
except ToolError as e:
    print(e.code, e.message)
print("still running")
"""
    job = api.run(code, toolsets=[key])
    assert job["status"] == "completed", job["error"]
    lines = job["stdout"].splitlines()
    assert lines[0] == "{'result': 5}"
    assert lines[1] == "{'city': 'Lima', 'celsius': 21.5}"
    assert "'token': '[redacted]'" in lines[2]
    assert lines[3] == "thing 7"
    assert lines[4] == "mcp_tool_error Error executing tool boom: kaput"
    assert lines[5] == "still running"
    assert TOKEN not in json.dumps(job)


def test_a_tool_error_that_quotes_the_secret_is_redacted(api: Api, stdio_toolset: tuple[str, str]) -> None:
    """An error result is the server's text, as much as a result is: it reaches the code, the call's
    record and the job's events redacted."""
    key, _ = stdio_toolset
    code = f"""
from ptc_tools import ToolError
from ptc_tools.{key} import {class_name(key)} as M
try:
    M.refused()
except ToolError as e:
    print(e.code, "|", e.message)
"""
    job = api.run(code, toolsets=[key])
    assert job["status"] == "completed", job["error"]
    assert job["stdout"] == "mcp_tool_error | Error executing tool refused: 401 Unauthorized: token [redacted] was refused\n"
    events = api.get(f"/api/v1/exec/{job['id']}/events", timeout=30).text
    calls = api.get("/api/v1/tool-calls", params={"exec": job["id"]}).text
    assert "[redacted]" in calls
    assert [where for where, text in (("job", json.dumps(job)), ("events", events), ("calls", calls)) if TOKEN in text] == []


def test_one_server_per_worker_process_and_none_left_behind(
    api: Api, staff: Api, stack: Stack, stdio_toolset: tuple[str, str]
) -> None:
    key, marker = stdio_toolset
    code = f"""
import json
from concurrent.futures import ThreadPoolExecutor
from ptc_tools.{key} import {class_name(key)} as M
with ThreadPoolExecutor(12) as pool:
    found = list(pool.map(lambda _: M.whoami()["pid"], range(24)))
sorted(set(found))
"""
    job = api.run(code, toolsets=[key])
    assert job["status"] == "completed", job["error"]
    assert len(job["return_value"]) == 1  # 24 calls from 12 threads, one server
    worker = stack.tools_worker.proc.pid  # type: ignore[union-attr]
    assert _servers(worker, marker) == job["return_value"]

    # A changed config is a new session; the old server is stopped, not leaked.
    config = mcp_stdio_config(marker, TOKEN="{{secrets.TOKEN}}", EXTRA_TOOL="1", CHANGED="yes")
    assert staff.http.patch(f"/api/v1/toolsets/{key}", json={"config": config}).status_code == 200
    time.sleep(2.5)  # the tools worker caches a tool's row for 2 s
    second = api.run(code, toolsets=[key])
    assert second["status"] == "completed", second["error"]
    assert second["return_value"] != job["return_value"]
    assert _wait_for(lambda: _servers(worker, marker) == second["return_value"])
    assert not alive(job["return_value"][0])


def test_a_call_that_outlives_its_timeout(api: Api, staff: Api, stdio_toolset: tuple[str, str]) -> None:
    key, _ = stdio_toolset
    # An edit through the API (a tool's timeout) keeps the server's own name of a renamed tool.
    tools = staff.get(f"/api/v1/toolsets/{key}").json()["tools"]
    for tool in tools:
        tool.pop("signature"), tool.pop("ptc")
        if tool["name"] == "slow":
            tool["timeout"] = 1
    assert staff.http.patch(f"/api/v1/toolsets/{key}", json={"tools": tools}).status_code == 200
    code = f"""
from ptc_tools import ToolError
from ptc_tools.{key} import {class_name(key)} as M
try:
    M.slow(seconds=5)
except ToolError as e:
    print(e.code, "|", e.message)
print(M.get_thing(thing_id="after"))
"""
    job = api.run(code, toolsets=[key])
    assert job["status"] == "completed", job["error"]
    assert job["stdout"] == "mcp_timeout | MCP tool 'slow' did not answer within 1 s\nthing after\n"


def test_a_server_listing_odd_tools_syncs_the_good_ones_and_reports_the_rest(
    staff: Api, create_toolset: Callable[..., dict[str, Any]]
) -> None:
    """A tool the database can't hold as listed is skipped, with why, as one with a bad schema is
    (one whose pattern no call could be checked against too: before, it was synced, and each of
    its calls failed invalid_arguments): the others are synced, not rolled back with a 500."""
    key = unique_key("odd")
    config = mcp_stdio_config(uuid.uuid4().hex, BAD_MCP_SERVER, "odd_list", TOKEN="{{secrets.TOKEN}}")
    create_toolset({"key": key, "name": "Odd", "kind": "mcp", "config": config, "secrets": {"TOKEN": TOKEN}})
    sync = staff.post(f"/api/v1/toolsets/{key}/sync")
    assert sync.status_code == 200, sync.text
    assert TOKEN not in sync.text
    assert sync.json()["added"] == ["whoami", "a" * 128]
    nul = "holds a NUL character (U+0000), which can't be stored"
    nested = "^(?:(?:a{100}){100}){100}$"
    too_large = (
        "whose repeats make it too large: its counted repeats written out, nested ones multiplied, are over 100,000 items; "
        "make them smaller"
    )
    assert sync.json()["skipped"] == [
        {"name": "n" * 200 + "…", "reason": "name: longer than 256 characters, which can't be stored"},
        {"name": "nul_desc", "reason": f"description: {nul}"},
        {"name": "nul_schema", "reason": f"inputSchema/properties/q/description: {nul}"},
        {"name": "", "reason": "name: empty, so it can't be called"},
        {"name": "whoami", "reason": "name: listed twice; the first is synced"},
        {
            "name": "leak_[redacted]",
            "reason": "name: holds one of the toolset's secrets, which would be shown to everyone it is granted to",
        },
        {"name": "huge_in", "reason": f"inputSchema: the schema has a pattern ({nested!r}) {too_large}"},
        {"name": "huge_out", "reason": f"outputSchema: the schema has a pattern ({nested!r}) {too_large}"},
    ]
    assert Tool.objects.get(toolset__key=key, name="a" * 128).remote_name == "a" * 200


def test_a_tool_the_server_drops_is_disabled_not_deleted(api: Api, staff: Api, stdio_toolset: tuple[str, str]) -> None:
    key, marker = stdio_toolset
    job = api.run(f"from ptc_tools.{key} import {class_name(key)} as M\nM.extra()", toolsets=[key])
    assert job["return_value"] == {"result": "extra"}, job["error"]
    config = mcp_stdio_config(marker, TOKEN="{{secrets.TOKEN}}", EXTRA_TOOL="0")
    assert staff.http.patch(f"/api/v1/toolsets/{key}", json={"config": config}).status_code == 200
    sync = staff.post(f"/api/v1/toolsets/{key}/sync").json()
    assert sync["disabled"] == ["extra"] and sync["added"] == []
    assert "extra" not in {t["name"] for t in sync["toolset"]["tools"]}
    extra = Tool.objects.get(toolset__key=key, name="extra")
    assert extra.enabled is False
    assert ToolCall.objects.get(call_id=job["tool_calls"][0]["call_id"]).tool_id == extra.pk


@pytest.fixture
def http_server() -> Iterator[str]:
    """The test MCP server over streamable HTTP on a free port; yield its URL."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, MCP_SERVER, "http", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # start-up only
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        proc.terminate()
        proc.wait(10)


def test_streamable_http(api: Api, staff: Api, http_server: str, create_toolset: Callable[..., dict[str, Any]]) -> None:
    key = unique_key("mcphttp")
    create_toolset(
        {"key": key, "name": "MCP over HTTP", "kind": "mcp", "config": {"transport": "streamable_http", "url": http_server}}
    )
    sync = staff.post(f"/api/v1/toolsets/{key}/sync")
    assert sync.status_code == 200, sync.text
    assert "add" in sync.json()["added"]
    code = f"""
from ptc_tools import ToolError
from ptc_tools.{key} import {class_name(key)} as M
try:
    M.boom(message="over http")
except ToolError as e:
    print(e.code, e.message)
M.add(a=40, b=2)
"""
    job = api.run(code, toolsets=[key])
    assert job["status"] == "completed", job["error"]
    assert job["stdout"] == "mcp_tool_error Error executing tool boom: over http\n"
    assert job["return_value"] == {"result": 42}


def test_an_answer_over_http_events_is_taken_up_to_a_calls_output_limit(
    api: Api, http_server: str, create_toolset: Callable[..., dict[str, Any]]
) -> None:
    """The SDK's server answers a call as an event, its output twice in it (as text and as structured
    content); its client refused any event of over 1 MiB, so an output of 600 KB, well within a
    call's limit (and taken from a server over stdio, or answering JSON), failed over HTTP: before
    the fix ("mcp_error | MCP tool 'configured': SSE stream failed: Server-sent event exceeded the
    1048576 byte limit."). An event is held to the bound a stdio line is."""
    key = unique_key("mcphttp_big")
    tool = {"name": "configured", "input_schema": {"type": "object", "properties": {"endpoint": {"type": "string"}}}}
    config = {"transport": "streamable_http", "url": http_server}
    create_toolset({"key": key, "name": key, "kind": "mcp", "config": config, "tools": [tool]})
    code = f"""
from ptc_tools import ToolError
from ptc_tools.{key} import {class_name(key)} as M
try:
    print("ok |", len(M.configured(endpoint="x" * 600_000)["result"]))
except ToolError as e:
    print(e.code, "|", e.message)
"""
    job = api.run(code, toolsets=[key])
    assert job["status"] == "completed", job["error"]
    assert job["stdout"] == "ok | 600000\n", job["stdout"][:300]


BAD_SERVERS = {
    "exit": ("mcp_start_failed", "license file"),
    "hang": ("mcp_init_timeout", "did not finish initializing within 2 s"),
    "garbage": ("mcp_bad_response", "answered initialize with garbage"),
}


@pytest.mark.parametrize("mode", sorted(BAD_SERVERS))
def test_a_bad_server_is_a_clear_error_and_leaves_nothing_running(
    mode: str, api: Api, staff: Api, stack: Stack, create_toolset: Callable[..., dict[str, Any]]
) -> None:
    code, words = BAD_SERVERS[mode]
    key, marker = unique_key(f"bad_{mode}"), uuid.uuid4().hex
    config = {**mcp_stdio_config(marker, BAD_MCP_SERVER, mode), "init_timeout": 2}
    tool = {"name": "anything", "input_schema": {"type": "object", "properties": {}}}
    create_toolset({"key": key, "name": "Bad", "kind": "mcp", "config": config, "tools": [tool]})

    logged = stack.web.log.stat().st_size
    began = time.monotonic()
    sync = staff.post(f"/api/v1/toolsets/{key}/sync")
    took = time.monotonic() - began
    assert sync.status_code == 502
    assert sync.json()["error"]["code"] == code and words in sync.json()["error"]["message"]
    # The server's failure, not ours: the web logs one warning with its code, not an ERROR "Bad Gateway".
    with stack.web.log.open("rb") as f:
        f.seek(logged)
        written = f.read().decode(errors="replace")
    assert f"WARNING ptc.api request failed: {code} (502)" in written and "Bad Gateway" not in written, written
    if mode == "hang":  # said at its timeout, not after the server's exit is waited for (the SDK's 2 s grace)
        assert took < 3.5, took

    job = api.run(
        f"from ptc_tools import ToolError\nfrom ptc_tools.{key} import {class_name(key)} as M\n"
        "try:\n    M.anything()\nexcept ToolError as e:\n    print(e.code, '|', e.message)\nprint('still running')",
        toolsets=[key],
    )
    assert job["status"] == "completed", job["error"]
    first, second = job["stdout"].splitlines()
    assert first.startswith(f"{code} | ") and words in first
    assert second == "still running"
    worker = stack.tools_worker.proc.pid  # type: ignore[union-attr]
    assert _wait_for(lambda: not _servers(worker, marker), 10), children(worker)


def test_a_server_that_prints_its_token_on_stdout_keeps_it_out_of_the_logs(
    api: Api, staff: Api, stack: Stack, create_toolset: Callable[..., dict[str, Any]]
) -> None:
    """A server that logs to stdout breaks the protocol. The SDK logs the line it could not parse, what
    the server said included; the logs of the web (a sync) and of the tools worker (a call) say which
    server broke it, never what it said."""
    secret = f"tok-{uuid.uuid4().hex}"
    key = unique_key("noisy")
    config = {**mcp_stdio_config(uuid.uuid4().hex, BAD_MCP_SERVER, "stdout_token", TOKEN="{{secrets.TOKEN}}"), "init_timeout": 2}
    tool = {"name": "anything", "input_schema": {"type": "object", "properties": {}}}
    create_toolset({"key": key, "name": "Noisy", "kind": "mcp", "config": config, "tools": [tool], "secrets": {"TOKEN": secret}})
    logs = {process.log: process.log.stat().st_size for process in (stack.web, stack.tools_worker)}

    sync = staff.post(f"/api/v1/toolsets/{key}/sync")
    assert sync.status_code == 502 and sync.json()["error"]["code"] == "mcp_bad_response", sync.text
    job = api.run(
        f"from ptc_tools import ToolError\nfrom ptc_tools.{key} import {class_name(key)} as M\n"
        "try:\n    M.anything()\nexcept ToolError as e:\n    print(e.code)",
        toolsets=[key],
    )
    assert job["stdout"] == "mcp_bad_response\n", job
    for log, offset in logs.items():
        with log.open("rb") as f:
            f.seek(offset)
            written = f.read().decode(errors="replace")
        # Not a piece of it either: pydantic's error quotes a long line's start and end.
        assert [part for part in (secret[:12], secret[-12:]) if part in written] == [], log.name
        assert f"mcp server sent an unparseable message; closing its session: of toolset '{key}'" in written, log.name


def test_what_the_sdk_logs_as_client_is_dropped_and_no_other_librarys_client_lines() -> None:
    """The SDK's ClientSession logs as "client", quoting what a server sent: dropped. Another
    library that names its logger so keeps its lines."""
    import logging

    import mcp.client.session

    client = logging.getLogger("client")
    from_sdk = client.makeRecord("client", logging.WARNING, mcp.client.session.__file__, 1, "invalid: %s", ("token",), None)
    from_elsewhere = client.makeRecord("client", logging.WARNING, __file__, 1, "a library of ours", (), None)
    assert (bool(client.filter(from_sdk)), bool(client.filter(from_elsewhere))) == (False, True)
    assert client.isEnabledFor(logging.WARNING)


def test_a_server_that_cannot_start_at_all(api: Api, create_toolset: Callable[..., dict[str, Any]]) -> None:
    key = unique_key("nocmd")
    config = {"transport": "stdio", "command": "/nonexistent/mcp-server"}
    tool = {"name": "anything", "input_schema": {"type": "object", "properties": {}}}
    create_toolset({"key": key, "name": "Missing", "kind": "mcp", "config": config, "tools": [tool]})
    job = api.run(
        f"from ptc_tools import ToolError\nfrom ptc_tools.{key} import {class_name(key)} as M\n"
        "try:\n    M.anything()\nexcept ToolError as e:\n    print(e.code, '|', e.message)",
        toolsets=[key],
    )
    assert job["stdout"].startswith("mcp_start_failed | the MCP server of toolset"), job
    assert "No such file or directory" in job["stdout"]


def test_the_pool_in_one_process_shares_a_server_and_closes_it() -> None:
    marker = uuid.uuid4().hex
    toolset = Toolset(id=uuid.uuid4(), key=unique_key("pool"), kind="mcp", config=mcp_stdio_config(marker))
    add = Tool(name="add")
    results: list[Any] = []

    def call(i: int) -> None:
        results.append(mcp.run(toolset=toolset, tool=add, arguments={"a": i, "b": 1}, timeout=10))

    threads = [threading.Thread(target=call, args=(i,)) for i in range(30)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(r["result"] for r in results) == list(range(1, 31))
    servers = _servers(os.getpid(), marker)
    assert len(servers) == 1
    with pytest.raises(ToolFailure) as failure:
        mcp.run(toolset=toolset, tool=Tool(name="no_such_tool"), arguments={}, timeout=10)
    assert failure.value.code == "mcp_tool_error"
    mcp.sessions_close()
    assert _servers(os.getpid(), marker) == []
    assert not alive(servers[0])


def test_a_server_error_is_the_servers_error_not_a_lost_connection() -> None:
    """JSON-RPC's server error -32000 is also the code the SDK gives a closed connection: a server
    that answers with it said something, and its session stays."""
    marker = uuid.uuid4().hex
    toolset = Toolset(
        id=uuid.uuid4(), key=unique_key("rpcerr"), kind="mcp", config=mcp_stdio_config(marker, BAD_MCP_SERVER, "rpc_error")
    )
    for _ in range(2):
        with pytest.raises(ToolFailure) as failure:
            mcp.run(toolset=toolset, tool=Tool(name="anything"), arguments={}, timeout=10)
        assert failure.value.code == "mcp_error", failure.value
        assert len(failure.value.message) < 3000
    [server] = _servers(os.getpid(), marker)  # one session, not restarted after each answer
    mcp.sessions_close()
    assert not alive(server)


def test_a_servers_stderr_is_cut_where_no_secret_is() -> None:
    """A server that dies says why from the end of its stderr: where that end is cut must not keep the
    end of a secret without its start, which redacting could not find."""
    toolset = Toolset(
        id=uuid.uuid4(),
        key=unique_key("stderr"),
        kind="mcp",
        config=mcp_stdio_config(uuid.uuid4().hex, BAD_MCP_SERVER, "exit_token", TOKEN="{{secrets.TOKEN}}"),
        secrets={"TOKEN": TOKEN},
    )
    with pytest.raises(ToolFailure) as failure:
        mcp.run(toolset=toolset, tool=Tool(name="anything"), arguments={}, timeout=10)
    assert failure.value.code == "mcp_start_failed"
    assert failure.value.message.endswith("exited while starting; its stderr ends: [redacted]"), failure.value.message
    mcp.sessions_close()


def test_worker_shutdown_stops_its_servers(api: Api, stack: Stack, stdio_toolset: tuple[str, str]) -> None:
    """A second tools worker takes some calls; stopped, it must leave no MCP server behind."""
    key, marker = stdio_toolset
    name = f"mcp-{uuid.uuid4().hex[:6]}@%h"
    argv = [sys.executable, "-m", "celery", "-A", "ptcproject", "worker", "-Q", "tools", "-c", "2", "-n", name, "-l", "info"]
    extra = Process("tools-worker-mcp", argv, stack.env, ready=" ready.")
    servers: list[int] = []
    try:
        extra.start()
        pid = extra.proc.pid  # type: ignore[union-attr]
        for _ in range(40):
            api.run(f"from ptc_tools.{key} import {class_name(key)} as M\nM.add(a=1, b=1)", toolsets=[key])
            servers = _servers(pid, marker)
            if servers:
                break
        assert servers, "the second worker never took a call"
    finally:
        extra.stop()
    assert all(not alive(server) for server in servers)
