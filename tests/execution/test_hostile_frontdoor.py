"""The front door (MCP at /mcp, a job's event stream) under hostile use: each test is a way a
hostile tester broke it, and holds now."""

import time
import uuid
from typing import Any

import httpx
import mcp_types as types
from django.conf import settings
from django.contrib.auth.models import User
from django.db import OperationalError
from mcp import Client
from mcp.shared.exceptions import MCPError

from execution import mcp_server
from tests.conftest import Api
from tests.execution.test_mcp_server import BUSY, _until, data, http_client, run
from tests.stack import Stack


def test_a_busy_jobs_stream_ends_when_its_key_is_revoked(api: Api) -> None:
    """The key was checked again only at a heartbeat, which a job that prints more often than one
    never gave: a revoked key read its stream to the job's end. Now it is checked as often, busy or quiet."""
    marker = uuid.uuid4().hex
    job = api.post("/api/v1/exec", json={"code": BUSY.format(marker=marker), "wait": 0}).json()
    minted = api.post("/api/v1/keys", json={"name": "watcher"}).json()
    watcher = httpx.Client(base_url=str(api.http.base_url), headers={"Authorization": f"Bearer {minted['key']}"})
    try:
        with watcher.stream("GET", f"/api/v1/exec/{job['id']}/events", timeout=60) as stream:
            lines = stream.iter_lines()
            assert any(marker in line for line in lines)  # the job runs, printing
            assert api.post(f"/api/v1/keys/{minted['id']}/revoke").status_code == 200
            began = time.monotonic()
            rest = list(lines)  # until the server closes it
        took = time.monotonic() - began
        assert took < 10, f"a revoked key read on for {took:.0f} s, to the job's end: {rest[-3:]}"
        assert not any("exec_end" in line for line in rest)
    finally:
        watcher.close()
        api.post(f"/api/v1/exec/{job['id']}/cancel")


def test_one_user_cannot_hold_every_redis_connection_with_event_streams(stack: Stack, api: Api) -> None:
    """Each open event stream holds a Redis connection (its blocking XREAD), and Redis's clients are
    the broker's too: one key could open streams until Redis refused every process. Past
    PTC_EVENT_STREAMS_PER_USER a user's next stream is 429 ``throttled``, and so is an MCP call
    that would follow its job the same way (and no job is made for it); one closed frees its place."""
    job = api.post("/api/v1/exec", json={"code": "import time\ntime.sleep(60)", "wait": 0}).json()
    url = f"/api/v1/exec/{job['id']}/events"
    limit = settings.PTC_EVENT_STREAMS_PER_USER
    opened: list[Any] = []  # each stream with its lines, held: a dropped line iterator closes its connection
    try:
        for _ in range(limit):
            stream = api.http.stream("GET", url, timeout=30)
            response = stream.__enter__()
            lines = response.iter_lines()
            opened.append((stream, lines))
            assert response.status_code == 200
            assert next(lines).startswith("retry:")
        refused = api.get(url, timeout=10)
        assert refused.status_code == 429, f"stream {limit + 1} of one user: {refused.status_code} {refused.text[:80]!r}"
        assert refused.json()["error"]["code"] == "throttled" and refused.headers["retry-after"]
        marker = uuid.uuid4().hex

        async def mcp_exec() -> types.CallToolResult:
            async with http_client(stack, api.key) as client:
                return await client.call_tool("exec_code", {"code": f"print('{marker}')"})

        followed = run(mcp_exec)
        assert followed.is_error and data(followed)["error"]["code"] == "throttled", followed
        assert not any(marker in j["code"] for j in api.get("/api/v1/exec").json()["results"]), "a refused call made a job"
        opened.pop()[0].__exit__(None, None, None)

        def admitted() -> bool:
            with api.http.stream("GET", url, timeout=30) as again:
                return again.status_code == 200

        assert _until(admitted, 10)
    finally:
        for stream, _ in opened:
            stream.__exit__(None, None, None)
        api.post(f"/api/v1/exec/{job['id']}/cancel")


def test_tools_list_in_a_database_outage_says_so_not_the_drivers_message(monkeypatch: Any) -> None:
    """tools/list let any failure through to the SDK, which answers with the exception's text: in an
    outage, the driver's message (the database's host, port and user) with code 0. Now it answers
    as tools/call does: database_unavailable, the driver's text left in the log."""
    user = User.objects.create_user(username=f"lister-{uuid.uuid4().hex[:8]}")
    secret = 'connection to server at "10.9.8.7", port 5432 failed: FATAL:  password authentication failed for user "ptc_prod"'

    async def down(user_id: int, discovery: bool) -> Any:
        raise OperationalError(secret)

    monkeypatch.setattr(mcp_server, "_tool_list", down)

    async def main() -> MCPError:
        # The JSON-RPC stream loop, as on stdio and on /mcp for 2025 clients.
        async with Client(mcp_server.mcp_server_build(user=mcp_server.McpUser(user.pk)), mode="legacy") as client:
            try:
                await client.list_tools()
            except MCPError as exc:
                return exc
        raise AssertionError("tools/list answered in an outage")

    error = run(main)
    assert "10.9.8.7" not in str(error.message) and "ptc_prod" not in str(error.message), error.message
    assert error.data == {"code": "database_unavailable"}, (error.code, error.message, error.data)
