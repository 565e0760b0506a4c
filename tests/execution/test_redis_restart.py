"""A Redis restart in the middle of a job: the job goes on, and nothing is left hanging.

This test runs its own Redis server and its own stack on it, so it can restart Redis freely.
"""

import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ptcproject.accounts.services import user_with_key_create
from tests.stack import Stack, free_port


class RedisServer:
    def __init__(self, directory: Path) -> None:
        self.port = free_port()
        self.directory = directory
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.directory),
            ],
            stdout=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while subprocess.run(["redis-cli", "-p", str(self.port), "ping"], capture_output=True).stdout != b"PONG\n":
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def redis_stack(stack_env: dict[str, str], tmp_path: Path) -> Iterator[tuple[RedisServer, Stack]]:
    if not shutil.which("redis-server"):
        pytest.fail("redis-server is needed for this test: apt-get install redis-server")
    redis = RedisServer(tmp_path)
    redis.start()
    env = {**stack_env, "CELERY_BROKER_URL": redis.url, "REDIS_URL": redis.url}
    stack = Stack(env, name="redis-restart")
    stack.start(beat=False)
    try:
        yield redis, stack
    finally:
        stack.stop()
        redis.stop()


def test_a_job_survives_a_redis_restart(redis_stack: tuple[RedisServer, Stack]) -> None:
    redis, stack = redis_stack
    _, key = user_with_key_create(username=f"redis-{free_port()}", create_user=True, staff=False, credits=100)
    http = httpx.Client(base_url=stack.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=60)
    code = """
import time
from ptc_tools.demo import Demo
first = Demo.add(a=1, b=1)
print("first done", flush=True)
time.sleep(4)
second = Demo.add(a=2, b=2)
(first, second)
"""
    job = http.post("/api/v1/exec", json={"code": code, "toolsets": ["demo"], "timeout": 60}).json()
    deadline = time.monotonic() + 15
    while not any(c["status"] == "completed" for c in http.get(f"/api/v1/exec/{job['id']}").json()["tool_calls"]):
        assert time.monotonic() < deadline, "the first call never completed"
        time.sleep(0.05)
    redis.stop()
    time.sleep(0.5)
    redis.start()  # empty: every queue, key and subscription is gone
    deadline = time.monotonic() + 45
    while (final := http.get(f"/api/v1/exec/{job['id']}").json())["status"] in ("queued", "running"):
        assert time.monotonic() < deadline, f"the job hung after the restart: {final}"
        time.sleep(0.2)
    assert final["status"] == "completed", final["error"]
    assert final["return_value"] == [2, 4]
    assert [c["status"] for c in final["tool_calls"]] == ["completed", "completed"]
    # And the stack takes new work on the new Redis.
    again = http.post("/api/v1/exec", json={"code": "'ok'", "toolsets": ["demo"], "wait": 30}).json()
    assert again["return_value"] == "ok"
