"""The MCP server under hostile use: each test is a way a hostile tester broke it, and holds now."""

import json
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from typing import Any

import anyio
import httpx
import httpx2
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from tests.conftest import Api
from tests.execution.test_mcp_server import _until
from tests.stack import ARTIFACTS, BIN, ROOT, Process, Stack, free_port

INIT = {
    "jsonrpc": "2.0",
    "id": 0,
    "method": "initialize",
    "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "hostile", "version": "0"}},
}
HEADERS = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}


def _jobs(api: Api) -> list[dict[str, Any]]:
    return api.get("/api/v1/exec").json()["results"]


def test_a_request_cancelled_while_its_job_is_created_cancels_the_job(stack: Stack, api: Api) -> None:
    """A cancel that lands while the job is being created cancels the job: none runs to its end unseen."""
    code_tpl = "import time\nprint('{m}', flush=True)\ntime.sleep(3)\n'finished'"
    leaked: list[tuple[float, str]] = []
    markers: dict[str, float] = {}

    async def once(delay: float, marker: str) -> None:
        http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {api.key}"}, timeout=httpx2.Timeout(30, read=60))
        async with Client(streamable_http_client(f"{stack.base_url}/mcp", http_client=http)) as client:
            with anyio.move_on_after(delay):
                await client.call_tool("exec_code", {"code": code_tpl.format(m=marker)})
                raise AssertionError("the call finished before the client cancelled it")

    # Bounded: 12 attempts over delays that straddle the job's creation (a few ms to tens of ms).
    for delay in (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.05, 0.01, 0.02, 0.03):
        marker = uuid.uuid4().hex
        markers[marker] = delay
        anyio.run(once, delay, marker)
    time.sleep(5)  # longer than the code's 3 s: a job nobody cancelled has finished by now
    for job in _jobs(api):
        for marker, delay in markers.items():
            if marker in job["code"] and job["status"] == "completed":
                leaked.append((delay, job["id"]))
    assert not leaked, f"jobs ran to completion although their MCP request was cancelled: {leaked}"


def test_one_user_cannot_take_every_session_slot(stack_env: dict[str, str], make_api: Any) -> None:
    """Sessions are capped per user (PTC_MCP_SESSIONS_PER_USER): one user past the cap gets 429; another still gets in."""
    attacker, victim = make_api(), make_api()
    port = free_port()
    web = Process(
        "web-session-cap",
        [str(BIN / "uvicorn"), "ptcproject.asgi:application", "--port", str(port), "--no-access-log"],
        {**stack_env, "PTC_MCP_SESSIONS_PER_USER": "3"},
        ready="Uvicorn running",
    )
    web.start()
    try:
        url = f"http://127.0.0.1:{port}/mcp"
        for _ in range(3):
            r = httpx.post(url, json=INIT, headers={**HEADERS, "Authorization": f"Bearer {attacker.key}"}, timeout=30)
            assert r.status_code == 200
        r = httpx.post(url, json=INIT, headers={**HEADERS, "Authorization": f"Bearer {attacker.key}"}, timeout=30)
        assert r.status_code == 429 and r.json()["error"]["code"] == "throttled", r.text
        assert r.headers["retry-after"]
        r = httpx.post(url, json=INIT, headers={**HEADERS, "Authorization": f"Bearer {victim.key}"}, timeout=30)
        assert r.status_code == 200, f"another user's sessions locked this user out: {r.status_code} {r.text}"

        # A burst sent at once is held to the cap too: the opening ones count before any has opened.
        async def burst(key: str, n: int) -> list[int]:
            async with httpx.AsyncClient(timeout=30, headers={**HEADERS, "Authorization": f"Bearer {key}"}) as client:
                answers = await anyio_gather(*[client.post(url, json=INIT) for _ in range(n)])
            return [a.status_code for a in answers]

        third = make_api()
        statuses = anyio.run(burst, third.key, 40)
        assert sorted(statuses) == [200] * 3 + [429] * 37, statuses
    finally:
        web.stop()


async def anyio_gather(*awaitables: Any) -> list[Any]:
    """``asyncio.gather`` for anyio: every awaitable at once, their results in order."""
    results: list[Any] = [None] * len(awaitables)

    async def one(i: int, awaitable: Any) -> None:
        results[i] = await awaitable

    async with anyio.create_task_group() as group:
        for i, awaitable in enumerate(awaitables):
            group.start_soon(one, i, awaitable)
    return results


def test_a_client_that_drops_mid_body_logs_no_error(stack: Stack, api: Api) -> None:
    """A client that closes mid-body is let go quietly: no ASGI traceback in the log."""
    log = ARTIFACTS / "web.log"
    before = log.read_text(errors="replace").count("ClientDisconnect")
    with socket.create_connection(("127.0.0.1", stack.port)) as sock:
        head = (
            "POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Authorization: Bearer {api.key}\r\nContent-Type: application/json\r\n"
            "Accept: application/json, text/event-stream\r\nContent-Length: 1000\r\n\r\n"
        )
        sock.sendall(head.encode() + b'{"jsonrpc":"2.0"')
        time.sleep(0.3)
    time.sleep(1.0)
    assert log.read_text(errors="replace").count("ClientDisconnect") == before, "an uncaught ClientDisconnect was logged"


def test_a_stdio_server_stopped_with_sigterm_cancels_its_job(stack: Stack, stack_env: dict[str, str], api: Api) -> None:
    """SIGTERM to `manage.py ptc_mcp` cancels the job it is serving before it exits."""
    marker = uuid.uuid4().hex
    proc = subprocess.Popen(
        [sys.executable, "manage.py", "ptc_mcp", "--user", api.username],
        cwd=ROOT,
        env=stack_env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    assert proc.stdin is not None and proc.stdout is not None

    def send(message: dict[str, Any]) -> None:
        assert proc.stdin is not None
        proc.stdin.write((json.dumps(message) + "\n").encode())
        proc.stdin.flush()

    try:
        send(INIT)
        proc.stdout.readline()
        send({"jsonrpc": "2.0", "method": "notifications/initialized"})
        code = f"import time\nprint('{marker}', flush=True)\ntime.sleep(6)\n'finished'"
        send({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "exec_code", "arguments": {"code": code}}})
        assert _until(lambda: any(marker in j["code"] and j["status"] == "running" for j in _jobs(api)), 20)
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    job = next(j for j in _jobs(api) if marker in j["code"])
    assert _until(lambda: api.get(f"/api/v1/exec/{job['id']}").json()["status"] != "running", 20)
    final = api.get(f"/api/v1/exec/{job['id']}").json()
    assert final["status"] == "cancelled", f"the stdio server's job outlived it: {final['status']}"


def test_the_seed_tool_defaults_under_the_policys_maximum(stack: Stack, make_api: Any) -> None:
    """The seed tool's default timeout (30 s) comes down to the policy's maximum when that is lower."""
    admin, user = make_api(staff=True), make_api()
    before = admin.get("/api/v1/policy").json()
    before.pop("updated_at")
    patched = admin.http.patch("/api/v1/policy", json={"default_timeout": 10, "max_timeout": 20})
    assert patched.status_code == 200, patched.text
    try:

        async def main() -> Any:
            http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {user.key}"}, timeout=httpx2.Timeout(30, read=60))
            async with Client(streamable_http_client(f"{stack.base_url}/mcp", http_client=http)) as client:
                return await client.call_tool("programmatic_tool_calling", {"code": "6 * 7"})

        result = anyio.run(main)
        assert result.is_error is False, f"the seed tool was refused under the policy's own maximum: {result.structured_content}"
    finally:
        assert admin.http.patch("/api/v1/policy", json=before).status_code == 200


def _rss_mb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) // 1024


def test_junk_arguments_are_refused_not_held(stack: Stack, api: Api) -> None:
    """A body over the API's limit is refused, and an unknown argument too: neither is held while a job runs."""
    assert stack.web.proc is not None
    pid = stack.web.proc.pid
    http = httpx.Client(headers={**HEADERS, "Authorization": f"Bearer {api.key}"}, timeout=60)
    opened = http.post(f"{stack.base_url}/mcp", json=INIT)
    session = opened.headers["mcp-session-id"]
    http.post(
        f"{stack.base_url}/mcp",
        json={"jsonrpc": "2.0", "method": "notifications/initialized"},
        headers={"Mcp-Session-Id": session},
    )
    junk: list[dict[str, Any]] = [{}] * 1_300_000
    calls = 4
    before = _rss_mb(pid)
    peak = before

    def one(n: int) -> None:
        arguments = {"code": "import time\ntime.sleep(12)", "x": junk}
        body = json.dumps(
            {"jsonrpc": "2.0", "id": 100 + n, "method": "tools/call", "params": {"name": "exec_code", "arguments": arguments}},
            separators=(",", ":"),  # compact: 3.9 MB, under the SDK's 4 MiB body limit
        )
        http.post(f"{stack.base_url}/mcp", content=body.encode(), headers={"Mcp-Session-Id": session})

    threads = [threading.Thread(target=one, args=(n,)) for n in range(calls)]
    for t in threads:
        t.start()
    for _ in range(16):  # bounded: sample while the jobs sleep
        time.sleep(0.5)
        peak = max(peak, _rss_mb(pid))
    for t in threads:
        t.join(60)
    grown = peak - before
    assert grown < 80, f"{calls} calls of {len(junk)} ignored empty objects grew the web process by {grown} MB"
    small = {
        "jsonrpc": "2.0",
        "id": 200,
        "method": "tools/call",
        "params": {"name": "exec_code", "arguments": {"code": "1", "x": 1}},
    }
    answer = http.post(f"{stack.base_url}/mcp", json=small, headers={"Mcp-Session-Id": session})
    assert "takes no argument" in answer.text and "'x'" in answer.text, answer.text
