"""A Redis restart in the middle of a job: the job goes on, and nothing is left hanging.

This test runs its own Redis server and its own stack on it, so it can restart Redis freely.
"""

import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from ptcproject.accounts.services import user_with_key_create
from tests.conftest import Api
from tests.servers import RedisServer
from tests.stack import Stack, free_port


def test_a_job_survives_a_redis_restart(redis_stack: tuple[RedisServer, Stack]) -> None:
    redis, stack = redis_stack
    _, key = user_with_key_create(username=f"redis-{free_port()}", create_user=True, staff=False, credits=100)
    http = httpx.Client(base_url=stack.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=60)
    code = """
import subprocess
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


def _subscriptions_cut(redis: RedisServer) -> int:
    """Close every process's subscription connection on ``redis``, as a blip of the network would;
    return how many were closed. Each process reconnects half a second later."""
    import redis as redis_py

    from execution.backplane import SUBSCRIPTIONS_CLIENT

    with redis_py.Redis.from_url(redis.url) as client:
        ours = [found["id"] for found in client.client_list() if found.get("name") == SUBSCRIPTIONS_CLIENT]
        for client_id in ours:
            client.client_kill_filter(_id=client_id)
    return len(ours)


@contextmanager
def _approval_awaited(stack: Stack, seconds: int) -> Iterator[tuple[Api, dict[str, Any], dict[str, Any]]]:
    """A job of 2 s whose one call waits for an approval and then runs ``seconds`` (a staff-made
    http toolset, its upstream on loopback for as long as the block): its owner, the job, and the
    call as its tool_call_pending event shows it."""
    from tests.execution.test_approvals import pending
    from tests.tools.conftest import unique_key
    from tests.tools.http_api import HttpApi
    from tools.sdk import class_name

    staff_user, staff_key = user_with_key_create(username=f"staff-{free_port()}", create_user=True, staff=True, credits=0)
    owner_user, owner_key = user_with_key_create(username=f"owner-{free_port()}", create_user=True, staff=False, credits=100)
    staff, owner = Api(stack.base_url, staff_key, staff_user.username), Api(stack.base_url, owner_key, owner_user.username)
    with HttpApi(expected_key="unused") as upstream:
        key = unique_key("slow")
        tool = {
            "name": "wait",
            "input_schema": {"type": "object", "properties": {"seconds": {"type": "string"}}, "required": ["seconds"]},
            "requires_approval": True,
            "http": {"method": "GET", "path": "/slow", "query": ["seconds"]},
        }
        config = {"base_url": upstream.url, "timeout": 10}
        made = staff.post(
            "/api/v1/toolsets", json={"key": key, "name": "Slow", "kind": "http", "config": config, "tools": [tool]}
        )
        assert made.status_code == 201, made.text
        code = f"from ptc_tools.{key} import {class_name(key)} as S\nS.wait(seconds='{seconds}')"
        job = owner.post("/api/v1/exec", json={"code": code, "toolsets": [key], "timeout": 2, "wait": 0}).json()
        [block] = pending(owner, job["id"])
        yield owner, job, block


def test_an_approval_pushed_while_the_worker_reconnects_still_restarts_the_jobs_clock(
    redis_stack: tuple[RedisServer, Stack],
) -> None:
    # A call waiting for an approval stops its job's clock; the Approved push starts it again (and
    # gives the call its tool's timeout). Pushed while the exec worker's subscription was down, it
    # was lost, and the reconnect looked up only calls that had finished: the approved call ran
    # with its job's clock stopped, past the job's timeout.
    from tests.execution.test_approvals import finished

    redis, stack = redis_stack
    with _approval_awaited(stack, seconds=4) as (owner, job, block):
        assert _subscriptions_cut(redis) == 1  # the exec worker's (the web subscribes only while a submit waits)
        decided = owner.post(f"/api/v1/tool-calls/{block['id']}/approval", json={"approve": True})
        assert decided.status_code == 200, decided.text
        final = finished(owner, job["id"])
    # 2 s of the job's own time, of which the 4 s call took the rest: it ends timeout, not completed.
    assert final["status"] == "timeout", (final["status"], final["error"])


def test_a_redis_that_refuses_client_setname_still_carries_the_subscriptions(tmp_path: Path, settings: Any) -> None:
    # A Redis whose ACL refuses the CLIENT commands (a managed one, a locked-down user) answers
    # CLIENT SETNAME with NOPERM. redis-py raises it from the connect: naming the subscription
    # connection made every subscription fail, so no job ever heard a result, cancel or approval.
    from execution.backplane import Cancel, RedisBackplane

    redis = RedisServer(tmp_path)
    redis.start()
    try:
        acl = ["ACL", "SETUSER", "ptc", "on", ">secret", "~*", "&*", "+@all", "-client"]
        subprocess.run(["redis-cli", "-p", str(redis.port), *acl], check=True, capture_output=True)
        settings.REDIS_URL = f"redis://ptc:secret@127.0.0.1:{redis.port}/0"
        plane = RedisBackplane()
        with plane.subscribe("ptc:test:named") as subscription:
            assert plane.publish("ptc:test:named", Cancel())
            subscription.wait(5)
            assert subscription.drain() == [Cancel()]
    finally:
        redis.stop()


def test_an_approved_call_that_ends_while_the_worker_is_cut_off_counts_on_the_jobs_clock(
    redis_stack: tuple[RedisServer, Stack],
) -> None:
    # The exec worker's subscription stays down while a call is approved, runs and ends: both the
    # Approved and the Result pushes are lost. The reconnect finds the call finished and answers
    # it, but the job's clock had stayed stopped from the call's start to the reconnect, as if the
    # call had waited for its approval all along: its 3 s of running were never counted, and a job
    # of 2 s completed.
    import threading

    from tests.execution.test_approvals import finished

    redis, stack = redis_stack
    cut_off = threading.Event()

    def cut() -> None:  # every subscription connection, as soon as it is back
        while not cut_off.is_set():
            _subscriptions_cut(redis)
            time.sleep(0.002)

    with _approval_awaited(stack, seconds=3) as (owner, job, block):
        killer = threading.Thread(target=cut)
        killer.start()
        try:
            time.sleep(0.3)
            decided = owner.post(f"/api/v1/tool-calls/{block['id']}/approval", json={"approve": True})
            assert decided.status_code == 200, decided.text
            deadline = time.monotonic() + 15
            while owner.get(f"/api/v1/exec/{job['id']}").json()["tool_calls"][0]["status"] == "executing":
                assert time.monotonic() < deadline
                time.sleep(0.1)
            time.sleep(0.5)
        finally:
            cut_off.set()
            killer.join()
        final = finished(owner, job["id"])
    assert final["status"] == "timeout", (final["status"], final["error"])
