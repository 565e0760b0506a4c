"""The embedded default (SQLite, the filesystem broker, no Redis): jobs, tool calls and SSE events."""

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.execution.test_events import JOB, _check_sequence, read_events
from tests.stack import ROOT, Stack


@pytest.fixture(scope="module")
def embedded(tmp_path_factory: pytest.TempPathFactory, stack_env: dict[str, str]) -> Iterator[tuple[Stack, str]]:
    data = tmp_path_factory.mktemp("embedded")
    env = {k: v for k, v in stack_env.items() if k not in ("DATABASE_URL", "CELERY_BROKER_URL", "REDIS_URL", "PTC_REDIS_PREFIX")}
    env["PTC_DATA_DIR"] = str(data)
    subprocess.run([sys.executable, "manage.py", "migrate", "-v0"], cwd=ROOT, env=env, check=True)
    key = subprocess.run(
        [sys.executable, "manage.py", "create_api_key", "embedded", "--create-user", "--credits", "100"],
        cwd=ROOT,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.splitlines()[-1]
    stack = Stack(env, name="embedded")
    stack.start(beat=False)
    try:
        yield stack, key
    finally:
        stack.stop()


class _Client:
    def __init__(self, base_url: str, key: str) -> None:
        self.http = httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def test_embedded_jobs_and_events_from_the_records(embedded: tuple[Stack, str]) -> None:
    stack, key = embedded
    client = _Client(stack.base_url, key)
    response = client.http.post("/api/v1/exec", json={"code": JOB, "toolsets": ["demo"], "wait": 0})
    assert response.status_code == 201
    job_id = response.json()["id"]
    events, _ = read_events(client, job_id)  # type: ignore[arg-type]
    job = client.http.get(f"/api/v1/exec/{job_id}").json()
    assert job["status"] == "completed", job["error"]
    assert job["credits_charged"] == 4
    _check_sequence(events, job, with_output=False)
    assert Path(stack.env["PTC_DATA_DIR"], "db.sqlite3").exists()


def test_embedded_serves_mcp_over_http_and_stdio(embedded: tuple[Stack, str]) -> None:
    """/mcp and ptc_mcp on the embedded default: progress comes from the records, woken by the job's channel."""
    from tests.execution.test_mcp_server import call, http_client, run, stdio_client

    stack, key = embedded
    code = "from ptc_tools.demo import Demo\nDemo.add(a=1, b=2)"
    progress: list[str] = []

    async def on_progress(value: float, total: float | None, message: str | None) -> None:
        progress.append(message or "")

    async def main() -> tuple[dict, dict]:
        async with http_client(stack, key) as client:
            over_http = await call(client, "exec_code", {"code": code, "toolsets": ["demo"]}, progress_callback=on_progress)
        async with stdio_client(stack.env, "embedded") as client:
            over_stdio = await call(client, "programmatic_tool_calling", {"code": code})
        return over_http, over_stdio

    over_http, over_stdio = run(main)
    assert over_http["status"] == "completed" and over_http["return_value"] == 3
    assert any(m.startswith("tool call finished: demo.add") for m in progress)
    assert over_stdio["success"] is True and over_stdio["return_value"] == 3


def test_embedded_sessions_route_to_their_worker(embedded: tuple[Stack, str]) -> None:
    """A session on the filesystem broker: its later jobs reach its worker's direct queue."""
    stack, key = embedded
    client = _Client(stack.base_url, key)
    session = client.http.post("/api/v1/sessions", json={"toolsets": ["demo"]}).json()
    values = []
    for code in ("n = 40", "n += 1", "n + 1"):
        job = client.http.post("/api/v1/exec", json={"code": code, "session": session["id"], "wait": 30}).json()
        assert job["status"] == "completed", job["error"]
        values.append(job["return_value"])
    assert values == [None, None, 42]
    assert client.http.delete(f"/api/v1/sessions/{session['id']}").json()["status"] == "deleted"


def _channel_folders(stack: Stack) -> set[str]:
    """The channels' folders of the embedded stack's backplane (one a channel, under the temp dir)."""
    env = {**stack.env, "DJANGO_SETTINGS_MODULE": "ptcproject.settings"}
    code = "import django; django.setup(); from execution.backplane import _socket_dir; print(_socket_dir('x').parent)"
    root = Path(
        subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True, capture_output=True, text=True).stdout.strip()
    )
    return {p.name for p in root.iterdir()} if root.is_dir() else set()


def test_embedded_channels_leave_no_folders_behind(embedded: tuple[Stack, str]) -> None:
    """Each job's channels (its own, its end's) are folders of sockets: gone with their last subscriber."""
    stack, key = embedded
    client = _Client(stack.base_url, key)
    before = _channel_folders(stack)
    for _ in range(5):
        job = client.http.post("/api/v1/exec", json={"code": JOB, "toolsets": ["demo"], "wait": 30}).json()
        assert job["status"] == "completed", job["error"]
        read_events(client, job["id"])  # type: ignore[arg-type]
    deadline = time.monotonic() + 10
    while (left := _channel_folders(stack) - before) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"{len(left)} channel folders left behind by 5 jobs"
