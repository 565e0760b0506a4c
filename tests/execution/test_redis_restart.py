"""A Redis restart in the middle of a job: the job goes on, and nothing is left hanging.

This test runs its own Redis server and its own stack on it, so it can restart Redis freely.
"""

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ptcproject.accounts.services import user_with_key_create
from tests.servers import RedisServer
from tests.stack import Stack, free_port


@pytest.fixture
def redis_stack(stack_env: dict[str, str], tmp_path: Path) -> Iterator[tuple[RedisServer, Stack]]:
    redis = RedisServer(tmp_path)
    redis.start()
    env = {**stack_env, "CELERY_BROKER_URL": redis.url, "REDIS_URL": redis.url}
    stack = Stack(env, name="redis-restart")
    try:
        stack.start(beat=False)
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


def test_while_redis_is_down_a_job_is_refused_not_orphaned(redis_stack: tuple[RedisServer, Stack]) -> None:
    from execution.models import ExecJob

    redis, stack = redis_stack
    username = f"redis-down-{free_port()}"
    _, key = user_with_key_create(username=username, create_user=True, staff=False, credits=100)
    http = httpx.Client(base_url=stack.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=30)
    redis.stop()
    started = time.monotonic()
    refused = http.post("/api/v1/exec", json={"code": "print(1)", "toolsets": ["demo"], "wait": 5})
    assert time.monotonic() - started < 5
    assert refused.status_code == 503, refused.text
    assert refused.json()["error"]["code"] == "broker_unavailable"
    assert refused.headers["Retry-After"]
    # The client was told no, and no job waits queued for ever behind that answer.
    assert ExecJob.objects.filter(user__username=username).count() == 0
    started = time.monotonic()
    ready = httpx.get(f"{stack.base_url}/readyz", timeout=10)
    assert time.monotonic() - started < 2.5
    assert ready.status_code == 503
    assert "broker" in ready.json()["error"]["details"]
    redis.start()
    deadline = time.monotonic() + 30
    while (again := http.post("/api/v1/exec", json={"code": "'ok'", "toolsets": ["demo"], "wait": 20})).status_code != 201:
        assert time.monotonic() < deadline, again.text
        time.sleep(0.5)
    assert again.json()["return_value"] == "ok"
