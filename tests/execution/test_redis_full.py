"""Redis full (its maxmemory reached, noeviction): new work is refused with a clear error, work under
way ends with one, nothing is left half-written, and once there is room again the stack goes on."""

import time

import httpx
import redis as redis_py

from ptcproject.accounts.services import user_with_key_create
from tests.servers import RedisServer
from tests.stack import Stack, free_port


def _fill(url: str) -> redis_py.Redis:
    """Make the Redis at ``url`` full: its maxmemory below what it holds, noeviction (Redis's default)."""
    server = redis_py.Redis.from_url(url)
    server.config_set("maxmemory-policy", "noeviction")
    server.config_set("maxmemory", "1")
    return server


SLOW_CALLS = """
import time
from ptc_tools.demo import Demo
out = []
for i in range(40):
    out.append(Demo.add(a=i, b=1))
    time.sleep(0.1)
out
"""


def test_while_redis_is_full_work_is_refused_saying_so_and_the_stack_goes_on_after(
    redis_stack: tuple[RedisServer, Stack],
) -> None:
    from execution.models import ExecJob

    redis, stack = redis_stack
    username = f"full-{free_port()}"
    _, key = user_with_key_create(username=username, create_user=True, staff=False, credits=100)
    http = httpx.Client(base_url=stack.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=60)
    running = http.post("/api/v1/exec", json={"code": SLOW_CALLS, "toolsets": ["demo"], "wait": 0}).json()
    deadline = time.monotonic() + 30
    while len(http.get("/api/v1/tool-calls", params={"exec": running["id"]}).json()["results"]) < 3:
        assert time.monotonic() < deadline, "the job made no calls"
        time.sleep(0.1)
    server = _fill(redis.url)

    # New work: refused at once, saying why, and no job left queued behind the answer.
    refused = http.post("/api/v1/exec", json={"code": "print(1)", "toolsets": ["demo"], "wait": 10})
    assert refused.status_code == 503, refused.text
    error = refused.json()["error"]
    assert error["code"] == "broker_unavailable" and "full" in error["message"] and "maxmemory" in error["message"], error
    assert ExecJob.objects.filter(user__username=username).count() == 1  # the running one only

    # Work under way: its next call can't be queued; the job ends with that error, recorded whole.
    while (job := http.get(f"/api/v1/exec/{running['id']}").json())["status"] in ("queued", "running"):
        assert time.monotonic() < deadline + 30, "the job did not end"
        time.sleep(0.2)
    assert job["status"] == "failed" and job["error"]["code"] == "broker_unavailable", job["error"]
    assert "is full (Redis has reached its maxmemory)" in job["error"]["message"], job["error"]
    calls = http.get("/api/v1/tool-calls", params={"exec": running["id"], "page_size": 100}).json()["results"]
    completed = [call for call in calls if call["status"] == "completed"]
    assert [call["status"] for call in calls if call not in completed] == ["failed"]
    # Each call that ran charged once (Demo.add: 1 credit), the one refused nothing, nothing held.
    balance = http.get("/api/v1/billing/balance").json()
    assert (balance["balance"], balance["reserved"]) == (100 - len(completed), 0)

    # Every process outlived it (an exec worker died of its acks, refused in a MULTI) and, once Redis
    # has room again, takes work as before.
    assert [(process.name, process.proc.poll()) for process in stack.processes if process.proc] == [
        (process.name, None) for process in stack.processes if process.proc
    ]
    server.config_set("maxmemory", "0")
    again = http.post(
        "/api/v1/exec", json={"code": "from ptc_tools.demo import Demo\nDemo.add(a=1, b=2)", "toolsets": ["demo"], "wait": 30}
    )
    assert again.status_code == 201 and again.json()["return_value"] == 3, again.text
