"""PTC as an MCP server, driven by the official ``mcp`` client over both transports: streamable HTTP
against the stack's real uvicorn (``/mcp``), and stdio by spawning ``manage.py ptc_mcp``. Every job
runs on the real exec and tools workers, and is recorded and billed as through the REST API."""

import json
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import httpx
import httpx2
import mcp_types as types
import pytest
from mcp import Client
from mcp.client.stdio import StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

from ptcproject.accounts.services import api_key_create
from tests.conftest import Api
from tests.stack import BIN, ROOT, Process, Stack, free_port

SEED_KEYS = {
    "success",
    "execution_time_seconds",
    "timeout_limit_seconds",
    "stdout",
    "stderr",
    "tool_calls",
    "tool_results",
    "return_value",
    "error",
    "file_path",
}


def http_client(stack: Stack, key: str, **options: Any) -> Client:
    """An MCP client on the stack's /mcp with ``key`` as its Bearer token."""
    http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {key}"}, timeout=httpx2.Timeout(30, read=120))
    return Client(streamable_http_client(f"{stack.base_url}/mcp", http_client=http), **options)


def stdio_client(stack_env: dict[str, str], username: str, **options: Any) -> Client:
    """An MCP client that spawns ``manage.py ptc_mcp --user NAME`` with the stack's environment."""
    params = StdioServerParameters(
        command=sys.executable, args=["manage.py", "ptc_mcp", "--user", username], env=stack_env, cwd=str(ROOT)
    )
    return Client(params, **options)


def run(main: Callable[[], Awaitable[Any]]) -> Any:
    return anyio.run(main)


def data(result: types.CallToolResult) -> Any:
    assert result.content and isinstance(result.content[0], types.TextContent)
    parsed = json.loads(result.content[0].text)
    assert parsed == result.structured_content
    return parsed


async def call(client: Client, name: str, arguments: dict[str, Any], **options: Any) -> Any:
    return data(await client.call_tool(name, arguments, **options))


# -- Streamable HTTP ------------------------------------------------------------------------------
def test_http_lists_the_tools_with_the_users_compact_reference(stack: Stack, api: Api, staff: Api) -> None:
    async def main() -> list[types.Tool]:
        async with http_client(stack, api.key) as client:
            return (await client.list_tools()).tools

    # A client toolset is there, as in any deployment with an app's UI tools.
    ui = f"ui_{uuid.uuid4().hex[:6]}"
    confirm = {"name": "confirm", "input_schema": {"type": "object", "properties": {}}}
    created = staff.post("/api/v1/toolsets", json={"key": ui, "name": "UI", "kind": "client", "tools": [confirm]})
    assert created.status_code == 201, created.text
    try:
        tools = {tool.name: tool for tool in run(main)}
        # The compact reference of POST /api/v1/ptc/context, for the toolsets an exec_code without
        # toolsets is granted: this user's, but client ones.
        keys = [toolset["key"] for toolset in api.get("/api/v1/toolsets").json() if toolset["kind"] != "client"]
        context = api.post("/api/v1/ptc/context", json={"toolsets": keys}).json()
    finally:
        staff.http.delete(f"/api/v1/toolsets/{ui}")
    assert set(tools) == {"exec_code", "programmatic_tool_calling", "list_toolsets", "describe_tool"}
    description = tools["exec_code"].description or ""
    assert ui not in description
    reference = next(t for t in context["tools"] if t["name"] == "exec_code")["description"]
    assert description.startswith(reference)
    assert "from ptc_tools.demo import Demo" in description and "add(a: number, b: number)" in description
    assert reference in (tools["programmatic_tool_calling"].description or "")
    assert tools["programmatic_tool_calling"].input_schema["properties"]["timeout"]["default"] == 30


def test_http_exec_code_runs_a_job_recorded_and_billed_as_through_rest(stack: Stack, api: Api) -> None:
    before = api.get("/api/v1/billing/balance").json()["balance"]

    async def main() -> Any:
        async with http_client(stack, api.key) as client:
            return await call(client, "exec_code", {"code": "from ptc_tools.demo import Demo\nprint('hi')\nDemo.add(a=1, b=2)"})

    job = run(main)
    assert job["status"] == "completed" and job["success"] is True
    assert job["return_value"] == 3 and job["stdout"] == "hi\n"
    assert [(c["tool"], c["status"], c["output"]) for c in job["tool_calls"]] == [("add", "completed", 3)]
    # The same job, record and bill as the REST API has them.
    rest = api.get(f"/api/v1/exec/{job['id']}").json()
    assert rest["status"] == "completed" and rest["tool_calls"][0]["call_id"] == job["tool_calls"][0]["call_id"]
    assert rest["credits_charged"] == job["credits_charged"] == 1
    usage = api.get("/api/v1/billing/usage", params={"exec": job["id"]}).json()["results"]
    assert [row["amount"] for row in usage] == [1]
    assert api.get("/api/v1/billing/balance").json()["balance"] == before - 1


def test_the_seed_tool_answers_the_seed_json(stack: Stack, api: Api) -> None:
    code = """
from ptc_tools import ToolError
from ptc_tools.demo import Demo
print("adding")
total = Demo.add(a=2, b=3)
try:
    Demo.fail(message="on purpose")
except ToolError as e:
    print("caught", e.code)
total
"""

    async def main() -> Any:
        async with http_client(stack, api.key) as client:
            return await call(client, "programmatic_tool_calling", {"code": code, "filename": "seed.py"})

    result = run(main)
    assert SEED_KEYS <= set(result)
    assert result["success"] is True and result["error"] is None
    assert result["timeout_limit_seconds"] == 30  # the seed's default
    assert result["execution_time_seconds"] > 0
    assert result["stdout"] == "adding\ncaught tool_failed\n" and result["stderr"] == ""
    assert result["return_value"] == 5 and result["file_path"] == "seed.py"
    add, fail = result["tool_calls"]
    assert add["tool_name"] == "add" and add["args"] == {"a": 2, "b": 3} and add["parsed"] is True and add["has_error"] is False
    assert fail["tool_name"] == "fail" and fail["parsed"] is True and fail["has_error"] is True
    results = {r["tool_call_id"]: r for r in result["tool_results"]}
    assert results[add["tool_call_id"]] == {"tool_call_id": add["tool_call_id"], "observation": 5, "has_error": False}
    assert results[fail["tool_call_id"]]["has_error"] is True and "on purpose" in results[fail["tool_call_id"]]["observation"]
    # A job like any other: its calls are the records.
    calls = api.get("/api/v1/tool-calls", params={"exec": result["job_id"]}).json()["results"]
    assert [c["call_id"] for c in calls] == [add["tool_call_id"], fail["tool_call_id"]]


def test_the_seed_tool_reports_a_failure_and_a_timeout(stack: Stack, api: Api) -> None:
    async def main() -> tuple[Any, Any, types.CallToolResult]:
        async with http_client(stack, api.key) as client:
            failed = await call(client, "programmatic_tool_calling", {"code": "print('before')\n1 / 0"})
            timed_out = await call(client, "programmatic_tool_calling", {"code": "while True:\n    pass", "timeout": 1})
            too_long = await client.call_tool("exec_code", {"code": "1", "timeout": 10**6})
            return failed, timed_out, too_long

    failed, timed_out, too_long = run(main)
    assert failed["success"] is False and failed["stdout"] == "before\n"
    assert "ZeroDivisionError" in failed["error"] and failed["file_path"] is None
    assert timed_out["success"] is False and timed_out["timeout_limit_seconds"] == 1
    assert timed_out["error"].startswith("Timeout")
    assert api.get(f"/api/v1/exec/{timed_out['job_id']}").json()["status"] == "timeout"
    # Refused before anything ran: the API's error body, as the tool's error result.
    assert too_long.is_error is True
    assert data(too_long)["error"]["code"] == "validation_error"


def test_http_refuses_a_missing_bad_or_job_scoped_key(stack: Stack, api: Api) -> None:
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}
    headers = {"Accept": "application/json, text/event-stream"}
    missing = httpx.post(f"{stack.base_url}/mcp", json=body, headers=headers)
    bad = httpx.post(f"{stack.base_url}/mcp", json=body, headers={**headers, "Authorization": "Bearer ptc_nope_nope"})
    assert (missing.status_code, missing.json()["error"]["code"]) == (401, "not_authenticated")
    assert (bad.status_code, bad.json()["error"]["code"]) == (401, "authentication_failed")
    assert missing.headers["www-authenticate"].startswith("Bearer")
    # A job-scoped key is for POST /api/v1/tools/execute only.
    job = api.run("1", toolsets=["demo"])
    from django.contrib.auth.models import User

    from execution.models import ExecJob

    _, job_key = api_key_create(user=User.objects.get(username=api.username), exec_job=ExecJob.objects.get(pk=job["id"]))
    scoped = httpx.post(f"{stack.base_url}/mcp", json=body, headers={**headers, "Authorization": f"Bearer {job_key}"})
    assert (scoped.status_code, scoped.json()["error"]["code"]) == (403, "permission_denied")

    async def main() -> None:
        async with http_client(stack, "ptc_nope_nope") as client:
            await client.list_tools()

    with pytest.raises(Exception):  # noqa: B017 - the SDK's error for a 401 is its own business
        run(main)
    # The rest of the application is served as before, beside /mcp.
    assert httpx.get(f"{stack.base_url}/healthz").status_code == 200
    assert api.get("/api/v1/exec").status_code == 200


def test_a_session_is_bound_to_the_key_that_opened_it(stack: Stack, make_api: Callable[..., Api]) -> None:
    alice, mallory = make_api(), make_api()
    headers = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
    initialize = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "test", "version": "1"}},
    }
    opened = httpx.post(f"{stack.base_url}/mcp", json=initialize, headers={**headers, "Authorization": f"Bearer {alice.key}"})
    assert opened.status_code == 200, opened.text
    session = {**headers, "Mcp-Session-Id": opened.headers["mcp-session-id"], "MCP-Protocol-Version": "2025-11-25"}
    listing = {"jsonrpc": "2.0", "id": 2, "method": "tools/list"}
    stolen = httpx.post(f"{stack.base_url}/mcp", json=listing, headers={**session, "Authorization": f"Bearer {mallory.key}"})
    assert stolen.status_code == 404  # as if the session did not exist
    own = httpx.post(f"{stack.base_url}/mcp", json=listing, headers={**session, "Authorization": f"Bearer {alice.key}"})
    assert own.status_code == 200 and "exec_code" in own.text


def test_a_user_for_whom_ptc_is_disabled_gets_the_policys_reason(stack: Stack, staff: Api, api: Api) -> None:
    assert staff.http.patch("/api/v1/policy", json={"mode": "partial", "user_allowlist": []}).status_code == 200
    jobs_before = api.get("/api/v1/exec").json()["count"]

    async def main() -> tuple[list[types.Tool], types.CallToolResult, types.CallToolResult]:
        async with http_client(stack, api.key) as client:
            tools = (await client.list_tools()).tools
            refused = await client.call_tool("exec_code", {"code": "1"})
            seed = await client.call_tool("programmatic_tool_calling", {"code": "1"})
            return tools, refused, seed

    tools, refused, seed = run(main)
    reason = f"mode is partial and user '{api.username}' is not on the user allowlist"
    exec_code = next(t for t in tools if t.name == "exec_code")
    assert reason in (exec_code.description or "")
    for result in (refused, seed):
        assert result.is_error is True
        error = data(result)["error"]
        assert error["code"] == "ptc_disabled" and reason in error["message"]
        assert error["details"] == {"reason": reason}
    assert api.get("/api/v1/exec").json()["count"] == jobs_before  # nothing was recorded


def test_a_fanned_out_job_streams_progress_and_is_recorded_and_billed(stack: Stack, api: Api) -> None:
    code = """
import asyncio
from ptc_tools.demo import Demo
print("fanning out")
results = await asyncio.gather(*(Demo.sleep.aio(ms=300) for _ in range(10)))
print("done")
len(results)
"""
    progress: list[tuple[float, str | None]] = []

    async def on_progress(value: float, total: float | None, message: str | None) -> None:
        progress.append((value, message))

    async def main() -> Any:
        async with http_client(stack, api.key) as client:
            return await call(client, "exec_code", {"code": code}, progress_callback=on_progress)

    started = time.monotonic()
    job = run(main)
    elapsed = time.monotonic() - started
    assert job["status"] == "completed" and job["return_value"] == 10
    assert elapsed < 10  # in parallel: ten 300 ms calls, not one after another... on a noisy machine
    messages = [m or "" for _, m in progress]
    assert [v for v, _ in progress] == sorted(v for v, _ in progress)  # progress only increases
    assert sum(m.startswith("tool call started: demo.sleep") for m in messages) == 10
    assert sum(m.startswith("tool call finished: demo.sleep") for m in messages) == 10
    assert "stdout: fanning out\n" in messages
    assert messages.index("stdout: fanning out\n") < next(i for i, m in enumerate(messages) if m.startswith("tool call started"))
    # Every call is a record, each billed once.
    calls = api.get("/api/v1/tool-calls", params={"exec": job["id"]}).json()["results"]
    assert len(calls) == 10 and all(c["status"] == "completed" and c["credits"] == 1 for c in calls)
    ids_in_progress = {m.split()[4] for m in messages if m.startswith("tool call finished")}
    assert ids_in_progress == {c["call_id"] for c in calls}
    usage = api.get("/api/v1/billing/usage", params={"exec": job["id"]}).json()["results"]
    assert len(usage) == 10 and sum(row["amount"] for row in usage) == 10 == job["credits_charged"]


def _until(predicate: Callable[[], bool], seconds: float = 20) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return predicate()


def _cancel_after_first_output(client: Client, code: str) -> Callable[[], Awaitable[None]]:
    """Start exec_code with ``code``; once it has printed, cancel the call (notifications/cancelled)."""

    async def main() -> None:
        printed = anyio.Event()

        async def on_progress(value: float, total: float | None, message: str | None) -> None:
            if (message or "").startswith("stdout: "):
                printed.set()

        async with client:
            async with anyio.create_task_group() as tg:

                async def calling() -> None:
                    await client.call_tool("exec_code", {"code": code}, progress_callback=on_progress)

                tg.start_soon(calling)
                with anyio.fail_after(30):
                    await printed.wait()
                tg.cancel_scope.cancel()

    return main


def test_http_cancel_cancels_the_job_and_its_fan_out(stack: Stack, api: Api) -> None:
    marker = uuid.uuid4().hex
    # 16 calls in flight (the policy's parallel limit), 24 waiting for a slot: none of those may run.
    code = f"""
import asyncio
from ptc_tools.demo import Demo
print("{marker}", flush=True)
await asyncio.gather(*(Demo.sleep.aio(ms=2000) for _ in range(40)))
print("never")
"""
    started = time.monotonic()
    # The handshake era's notifications/cancelled (the 2026-07-28 wire cancels by closing the response).
    run(_cancel_after_first_output(http_client(stack, api.key, mode="legacy"), code))
    jobs = api.get("/api/v1/exec").json()["results"]
    job_id = next(j["id"] for j in jobs if marker in j["code"])
    assert _until(lambda: api.get(f"/api/v1/exec/{job_id}").json()["status"] == "cancelled")
    assert time.monotonic() - started < 20  # not the 6 s x 3 rounds the fan-out would take... loosely
    job = api.get(f"/api/v1/exec/{job_id}").json()
    assert job["error"]["type"] == "Cancelled"
    # The calls in flight end (within their 2 s); those waiting for a slot were never dispatched.
    assert _until(lambda: all(c["status"] != "executing" for c in api.get(f"/api/v1/exec/{job_id}").json()["tool_calls"]))
    # The cancel is recorded at once; what the code printed, by its worker as the job ends (its
    # calls may all have been failed unrun a moment before).
    assert _until(lambda: api.get(f"/api/v1/exec/{job_id}").json()["stdout"] == f"{marker}\n")
    final = api.get(f"/api/v1/exec/{job_id}").json()
    assert len(final["tool_calls"]) <= 16, "calls waiting for a slot were dispatched after the cancel"
    assert final["status"] == "cancelled"


# A job quiet after its first line, and one that prints without a pause as long as a heartbeat:
# its stream never falls quiet, and a heartbeat came only after a quiet one.
QUIET = "import time\nprint('{marker}', flush=True)\ntime.sleep(30)\nprint('never')"
BUSY = "import time\nprint('{marker}', flush=True)\nfor i in range(150):\n    print(i, flush=True)\n    time.sleep(0.2)\n'done'"


@pytest.mark.parametrize("job", [QUIET, BUSY], ids=["quiet", "busy"])
def test_a_job_whose_key_is_revoked_as_it_runs_is_cancelled_and_its_call_refused(stack: Stack, api: Api, job: str) -> None:
    """An exec_code call follows its job, sending its progress, for as long as it runs: a key revoked
    meanwhile kept reading it. At the next heartbeat the call now ends refused, and the job goes."""
    minted = api.post("/api/v1/keys", json={"name": "agent"}).json()
    marker = uuid.uuid4().hex
    code = job.format(marker=marker)

    async def main() -> tuple[types.CallToolResult, float]:
        async with http_client(stack, minted["key"]) as client:
            async with anyio.create_task_group() as tg:

                async def revoke() -> None:
                    await anyio.sleep(3)
                    revoked = await anyio.to_thread.run_sync(lambda: api.post(f"/api/v1/keys/{minted['id']}/revoke"))
                    assert revoked.status_code == 200

                tg.start_soon(revoke)
                began = time.monotonic()
                result = await client.call_tool("exec_code", {"code": code})
                return result, time.monotonic() - began

    result, took = run(main)
    assert result.is_error and data(result)["error"]["code"] == "authentication_failed", result
    assert took < 15, took  # the revoke at 3 s, found at a heartbeat (1 s here); not the job's 30 s
    job = next(j for j in api.get("/api/v1/exec").json()["results"] if marker in j["code"])
    assert _until(lambda: api.get(f"/api/v1/exec/{job['id']}").json()["status"] == "cancelled")


# -- stdio ----------------------------------------------------------------------------------------
def test_stdio_serves_the_same_tools_as_the_named_user(stack: Stack, stack_env: dict[str, str], api: Api) -> None:
    progress: list[str] = []

    async def on_progress(value: float, total: float | None, message: str | None) -> None:
        progress.append(message or "")

    async def main() -> tuple[list[types.Tool], Any, Any]:
        async with stdio_client(stack_env, api.username) as client:
            tools = (await client.list_tools()).tools
            seed = await call(
                client,
                "programmatic_tool_calling",
                {"code": "from ptc_tools.demo import Demo\nprint('x')\nDemo.add(a=20, b=22)"},
                progress_callback=on_progress,
            )
            described = await call(client, "describe_tool", {"name": "demo.add"})
            return tools, seed, described

    tools, seed, described = run(main)
    assert {t.name for t in tools} == {"exec_code", "programmatic_tool_calling", "list_toolsets", "describe_tool"}
    assert SEED_KEYS <= set(seed) and seed["success"] is True and seed["return_value"] == 42
    assert any(m.startswith("tool call finished: demo.add") for m in progress)
    assert described["signature"] == "add(a: number, b: number) -> number"
    # Run as that user: the job is theirs.
    assert api.get(f"/api/v1/exec/{seed['job_id']}").json()["credits_charged"] == 1


def test_stdio_cancel_cancels_the_job(stack: Stack, stack_env: dict[str, str], api: Api) -> None:
    marker = uuid.uuid4().hex
    code = f"import time\nprint('{marker}', flush=True)\ntime.sleep(60)\nprint('never')"
    started = time.monotonic()
    run(_cancel_after_first_output(stdio_client(stack_env, api.username), code))
    jobs = api.get("/api/v1/exec").json()["results"]
    job_id = next(j["id"] for j in jobs if marker in j["code"])
    assert _until(lambda: api.get(f"/api/v1/exec/{job_id}").json()["status"] == "cancelled")
    assert time.monotonic() - started < 45  # not the minute the code would sleep


def test_stdio_refuses_an_unknown_user(stack_env: dict[str, str]) -> None:
    import subprocess

    done = subprocess.run(
        [sys.executable, "manage.py", "ptc_mcp", "--user", f"nobody-{uuid.uuid4().hex[:6]}"],
        cwd=ROOT,
        env=stack_env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0 and "There is no active user" in done.stderr


# -- Discovery -----------------------------------------------------------------------------------
def test_list_toolsets_and_describe_tool(stack: Stack, api: Api) -> None:
    async def main() -> tuple[Any, Any, types.CallToolResult, types.CallToolResult, list[types.Tool]]:
        async with http_client(stack, api.key) as client:
            listed = await call(client, "list_toolsets", {})
            described = await call(client, "describe_tool", {"name": "Demo.sleep"})
            unknown = await client.call_tool("describe_tool", {"name": "demo.nope"})
            long = await client.call_tool("describe_tool", {"name": "x" * 100_000})
            try:
                await client.call_tool("y" * 100_000, {})
                raise AssertionError("a tool this server does not have was called")
            except MCPError as exc:
                nameless = exc
        # ?discovery=1: exec_code names tools only.
        http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {api.key}"})
        async with Client(streamable_http_client(f"{stack.base_url}/mcp?discovery=1", http_client=http)) as client:
            tools = (await client.list_tools()).tools
        return listed, described, unknown, long, nameless, tools

    listed, described, unknown, long, nameless, tools = run(main)
    demo = next(t for t in listed["toolsets"] if t["key"] == "demo")
    assert demo["import"] == "from ptc_tools.demo import Demo"
    assert "add(a: number, b: number) -> number" in demo["tools"]
    assert described["name"] == "sleep" and described["input_schema"]["required"] == ["ms"]
    assert unknown.is_error is True and data(unknown)["error"]["code"] == "unknown_tool"
    # A name no tool can have is not quoted back whole: a readable message, as the REST API's.
    assert data(long)["error"]["code"] == "unknown_tool" and len(data(long)["error"]["message"]) < 300
    assert "Unknown tool 'yyy" in str(nameless) and len(str(nameless)) < 300, str(nameless)[:100]
    discovery = next(t for t in tools if t.name == "exec_code").description or ""
    assert "demo.Demo: add, catalog_search, echo, fail, sleep" in discovery
    assert "add(a: number" not in discovery


def test_without_the_lifespan_mcp_says_why_and_django_is_unchanged(stack_env: dict[str, str], api: Api) -> None:
    port = free_port()
    web = Process(
        "web-no-lifespan",
        [str(BIN / "uvicorn"), "ptcproject.asgi:application", "--port", str(port), "--lifespan", "off"],
        stack_env,
        ready="Uvicorn running",
    )
    web.start()
    try:
        base = f"http://127.0.0.1:{port}"
        refused = httpx.post(f"{base}/mcp", json={}, headers={"Authorization": f"Bearer {api.key}"})
        assert (refused.status_code, refused.json()["error"]["code"]) == (503, "not_ready")
        assert httpx.get(f"{base}/healthz").status_code == 200
        assert httpx.get(f"{base}/api/v1/exec", headers={"Authorization": f"Bearer {api.key}"}).status_code == 200
    finally:
        web.stop()


def test_a_client_toolset_is_left_out_by_default_and_its_waiting_calls_say_how_to_answer(stack: Stack, staff: Api) -> None:
    """No MCP client can send a client tool's result: an exec_code without toolsets leaves client
    toolsets out; granted by name, a call of one says where its result is posted (the REST API)."""
    key = f"ui_{uuid.uuid4().hex[:6]}"
    cls = "".join(part.capitalize() for part in key.split("_"))
    confirm = {"name": "confirm", "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}}}
    created = staff.post("/api/v1/toolsets", json={"key": key, "name": "UI", "kind": "client", "tools": [confirm]})
    assert created.status_code == 201, created.text
    waiting: list[str] = []
    described: dict[str, str] = {}
    pending = anyio.Event()

    async def on_progress(value: float, total: float | None, message: str | None) -> None:
        if (message or "").startswith("tool call waits"):
            waiting.append(message or "")
            pending.set()

    async def main() -> tuple[Any, Any]:
        async with http_client(stack, staff.key) as client:
            listed = await client.list_tools()
            described["exec_code"] = next(tool.description for tool in listed.tools if tool.name == "exec_code") or ""
            default = await call(client, "exec_code", {"code": f"import ptc_tools.{key}"})
            answered: dict[str, Any] = {}

            async def calling() -> None:
                code = f"from ptc_tools.{key} import {cls}\n{cls}.confirm(q='ok?')"
                answered["job"] = await call(
                    client, "exec_code", {"code": code, "toolsets": [key]}, progress_callback=on_progress
                )

            async with anyio.create_task_group() as tg:
                tg.start_soon(calling)
                with anyio.fail_after(30):
                    await pending.wait()
                words = waiting[0].split()
                url, call_id = words[-1].rstrip(")"), words[-3]
                body = [{"tool_use_id": call_id, "content": "yes"}]
                posted = await anyio.to_thread.run_sync(lambda: staff.post(url, json=body))
                assert posted.status_code == 200, posted.text
            return default, answered["job"]

    try:
        default, job = run(main)
    finally:
        staff.http.delete(f"/api/v1/toolsets/{key}")
    assert "ptc_tools.demo" in described["exec_code"] and key not in described["exec_code"]  # not offered
    assert default["status"] == "failed" and default["error"]["type"] == "ModuleNotFoundError", default
    assert waiting[0].startswith(f"tool call waits for its result from the client: {key}.confirm ptc_"), waiting
    assert (job["status"], job["return_value"]) == ("completed", "yes"), job


def test_input_errors_read_as_the_apis_and_the_seed_tools_defaults_hold(stack: Stack, api: Api) -> None:
    async def main() -> tuple[types.CallToolResult, types.CallToolResult, Any]:
        async with http_client(stack, api.key) as client:
            nulls = await client.call_tool("exec_code", {"code": "1", "toolsets": [None]})
            missing = await client.call_tool("programmatic_tool_calling", {})
            default = await call(client, "programmatic_tool_calling", {"code": "1", "timeout": None})
            return nulls, missing, default

    nulls, missing, default = run(main)
    assert data(nulls)["error"]["message"] == "Invalid input. toolsets: 0: This field may not be null."
    assert data(missing)["error"]["message"] == "Invalid input. code: This field is required."
    assert default["success"] is True and default["timeout_limit_seconds"] == 30


def test_stdio_says_so_when_its_user_is_deactivated(stack_env: dict[str, str], make_api: Callable[..., Api]) -> None:
    from django.contrib.auth import get_user_model

    user = make_api()

    async def main() -> tuple[str, types.CallToolResult]:
        async with stdio_client(stack_env, user.username) as client:
            await client.list_tools()
            await anyio.to_thread.run_sync(
                lambda: get_user_model().objects.filter(username=user.username).update(is_active=False)
            )
            with pytest.raises(Exception) as listing:
                await client.list_tools()
            return str(listing.value), await client.call_tool("exec_code", {"code": "1"})

    listing, refused = run(main)
    assert "no longer active" in listing
    assert refused.is_error and data(refused)["error"]["code"] == "authentication_failed"
