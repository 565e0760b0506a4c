"""Hostile input and dead workers end cleanly: a stable error, nothing left running, output kept.

The lease tests run their own stack without beat, so they can kill its workers freely and show
that the exec workers' own reaper enforces the leases; and one with beat and no exec worker, that
beat's reaper runs on the workers that are up.
"""

import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import psycopg
import pytest

from tests.conftest import Api, own_deployment
from tests.servers import api_key
from tests.stack import Stack, free_port
from tools.models import Tool, Toolset

BAD_EVENT_IDS = ["abc", "-1", "1-x", ">", "$", "1-2-3", "9" * 30]


def test_a_bad_last_event_id_is_refused_and_holds_nothing(api: Api) -> None:
    job = api.run("print(1)", toolsets=["demo"])
    for _ in range(3):  # more bad requests than the web's pool has connections
        for bad in BAD_EVENT_IDS * 3:
            response = api.get(f"/api/v1/exec/{job['id']}/events", headers={"Last-Event-ID": bad})
            assert response.status_code == 400, (bad, response.text)
            assert response.json()["error"]["code"] == "invalid_last_event_id"
    for bad in ["１２３", "١٢٣-٠"]:  # digits, but not ASCII ones: a header can't carry them, the query can
        response = api.get(f"/api/v1/exec/{job['id']}/events", params={"last_event_id": bad})
        assert response.status_code == 400, (bad, response.text)
        assert response.json()["error"]["code"] == "invalid_last_event_id"
    started = time.monotonic()
    assert api.get("/api/v1/exec").status_code == 200
    assert time.monotonic() - started < 2


def test_open_and_cut_streams_hold_no_database_connection(api: Api) -> None:
    """More live streams than the web's pool has connections: every other endpoint still answers."""
    job = api.run("import time\ntime.sleep(6)", toolsets=["demo"], wait=0)
    release = threading.Event()
    opened = threading.Semaphore(0)

    def follow() -> None:
        with httpx.Client(base_url=str(api.http.base_url), headers={"Authorization": f"Bearer {api.key}"}) as http:
            with http.stream("GET", f"/api/v1/exec/{job['id']}/events", timeout=30) as response:
                next(response.iter_lines())
                opened.release()
                release.wait(20)  # then the client cuts the stream mid-job

    threads = [threading.Thread(target=follow) for _ in range(25)]
    for thread in threads:
        thread.start()
    try:
        for _ in threads:
            assert opened.acquire(timeout=20)
        for _ in range(3):
            started = time.monotonic()
            assert api.get("/api/v1/exec").status_code == 200
            assert api.get(f"/api/v1/exec/{job['id']}").status_code == 200
            assert time.monotonic() - started < 2
    finally:
        release.set()
        for thread in threads:
            thread.join(30)
    assert api.get("/api/v1/tool-calls").status_code == 200


def test_a_value_nested_too_deep_fails_the_job_and_keeps_its_output(api: Api) -> None:
    job = api.run("print('kept')\nx = []\nfor _ in range(600):\n    x = [x]\nx", toolsets=["demo"])
    assert job["status"] == "failed"
    assert job["error"]["type"] == "ResourceLimit"
    assert job["stdout"] == "kept\n"
    code = """
from ptc_tools import ToolError
from ptc_tools.demo import Demo
x = 1
for _ in range(150):
    x = [x]
try:
    Demo.echo(value=x)
except ToolError as e:
    print(e.code)
Demo.echo(value=[[1]])
"""
    job = api.run(code, toolsets=["demo"])
    assert job["status"] == "completed", job["error"]
    assert job["stdout"] == "invalid_arguments\n"
    assert job["return_value"] == [[1]]
    assert [c["status"] for c in job["tool_calls"]] == ["failed", "completed"]


def test_a_bridge_frame_nested_too_deep_is_a_bridge_error(api: Api) -> None:
    code = """
import os, struct
from ptc_tools import _runtime
print("sent", flush=True)
body = b'{"op":"call","id":1,"toolset":"demo","tool":"echo","args":{"value":' + b"[" * 100000 + b"]" * 100000 + b"}}"
os.write(_runtime._bridge._sock.fileno(), struct.pack(">I", len(body)) + body)
import time
time.sleep(10)
"""
    job = api.run(code, toolsets=["demo"])
    assert job["status"] == "failed"
    assert job["error"]["type"] == "BridgeError"
    assert job["stdout"] == "sent\n"
    assert api.run("'fine'", toolsets=["demo"])["return_value"] == "fine"


def test_a_traceback_a_million_frames_deep_is_reported_fast(api: Api) -> None:
    code = """
import sys
sys.setrecursionlimit(10**7)
def down(n):
    return down(n - 1) if n else 1 / 0
down(300_000)
"""
    started = time.monotonic()
    job = api.run(code, toolsets=["demo"], timeout=60)
    assert time.monotonic() - started < 20
    assert job["status"] == "failed"
    assert job["error"]["type"] == "ZeroDivisionError"
    trace = job["error"]["traceback"]
    assert "[... 299952 more frames ...]" in trace
    assert trace.endswith("ZeroDivisionError: division by zero\n")
    assert len(trace) < 10_000


def test_stdout_is_live_without_a_newline_or_flush(api: Api) -> None:
    job = api.run("import sys, time\nsys.stdout.write('first')\ntime.sleep(3)\nprint(' last')", toolsets=["demo"], wait=0)
    arrived: dict[str, float] = {}
    with api.http.stream("GET", f"/api/v1/exec/{job['id']}/events", timeout=30) as response:
        event = ""
        for line in response.iter_lines():
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: ") and event in ("stdout", "exec_end") and event not in arrived:
                arrived[event] = time.monotonic()
                if event == "stdout":
                    assert line.startswith('data: {"text":"first"')
    assert arrived["exec_end"] - arrived["stdout"] > 2


def test_a_builtin_tool_is_held_to_its_timeout(api: Api) -> None:
    from django.contrib.auth import get_user_model

    user = get_user_model().objects.get(username=api.username)
    # The user's own "demo" shadows the global one: the same builtin code, with a 1 s timeout.
    own = Toolset.objects.create(key="demo", name="Demo", kind="builtin", owner=user, is_global=False)
    schema = {"type": "object", "properties": {"ms": {"type": "integer"}}, "required": ["ms"]}
    Tool.objects.create(toolset=own, name="sleep", input_schema=schema, allowed_callers=["code_execution"], timeout=1)
    code = """
import time
from ptc_tools import ToolError
from ptc_tools.demo import Demo
started = time.monotonic()
try:
    Demo.sleep(ms=8000)
except ToolError as e:
    print(e.code, round(time.monotonic() - started))
Demo.sleep(ms=10)
"""
    job = api.run(code, toolsets=["demo"])
    assert job["status"] == "completed", job["error"]
    assert job["stdout"] == "tool_timeout 1\n"
    assert job["return_value"] == {"slept_ms": 10}


# -- Leases, with no beat ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def leases(stack_env: dict[str, str]) -> Iterator[Stack]:
    with own_deployment(stack_env, "leases") as stack:
        yield stack


@pytest.fixture
def lease_api(leases: Stack) -> Api:
    username = f"lease-{free_port()}"
    return Api(leases.base_url, api_key(leases.env, username), username)


def _final(api: Api, job_id: str, seconds: float) -> dict[str, Any]:
    deadline = time.monotonic() + seconds
    while (job := api.get(f"/api/v1/exec/{job_id}").json())["status"] in ("queued", "running"):
        assert time.monotonic() < deadline, f"the job did not end within {seconds} s: {job}"
        time.sleep(0.1)
    return job


def test_a_killed_tools_worker_fails_its_calls_within_the_lease(leases: Stack, lease_api: Api) -> None:
    code = """
from ptc_tools import ToolError
from ptc_tools.demo import Demo
print("calling", flush=True)
try:
    Demo.sleep(ms=50000)
except ToolError as e:
    print(e.code)
'after'
"""
    job = lease_api.run(code, toolsets=["demo"], wait=0, timeout=120)
    deadline = time.monotonic() + 15
    while not lease_api.get(f"/api/v1/exec/{job['id']}").json()["tool_calls"]:
        assert time.monotonic() < deadline, "the call was never made"
        time.sleep(0.05)
    time.sleep(1)  # a tools worker takes it within milliseconds
    leases.tools_worker.kill()
    killed = time.monotonic()
    try:
        final = _final(lease_api, job["id"], 30)
        # Lease (4 s) + reaper (1 s) + slack; not the call's timeout (60 s) + grace.
        assert time.monotonic() - killed < 12
        assert final["status"] == "completed", final["error"]
        assert final["stdout"] == "calling\nworker_lost\n"
        assert final["return_value"] == "after"
        assert final["tool_calls"][0]["error"]["code"] == "worker_lost"
    finally:
        leases.tools_worker.start()


def test_a_killed_exec_worker_fails_its_job_without_beat(leases: Stack, lease_api: Api) -> None:
    job = lease_api.run("import time\nprint('working', flush=True)\ntime.sleep(120)", toolsets=["demo"], wait=0, timeout=200)
    assert lease_api.until_printed(job["id"]) == "working\n"
    leases.exec_worker.kill()
    killed = time.monotonic()
    # Restarted at once, before the job's lease lapses: its start-up reap finds nothing yet, and its
    # own reaper must catch the lease when it does lapse.
    leases.exec_worker.start()
    final = _final(lease_api, job["id"], 30)
    assert time.monotonic() - killed < 4 + 1 + 8
    assert final["status"] == "failed"
    assert final["error"]["type"] == "WorkerLost"
    assert final["stdout"] == "working\n"


def _claimed_call(database_url: str, username: str, seconds: float) -> str:
    """The call id of ``username``'s call once a tools worker has claimed it (its record says so)."""
    deadline = time.monotonic() + seconds
    with psycopg.connect(database_url, autocommit=True) as conn:
        while True:
            row = conn.execute(
                "SELECT c.call_id FROM execution_toolcall c JOIN auth_user u ON u.id = c.user_id"
                " WHERE u.username = %s AND c.claimed_at IS NOT NULL",
                [username],
            ).fetchone()
            if row:
                return str(row[0])
            assert time.monotonic() < deadline, "no tools worker claimed the call"
            time.sleep(0.05)


def test_a_fleet_without_an_exec_worker_reaps_the_calls_of_a_killed_tools_worker(stack_env: dict[str, str]) -> None:
    """Beat, a tools worker and the web, no exec worker (all down, or a tools-only fleet): a call
    whose tools worker is killed as it runs ends worker_lost, its caller told, and its price goes
    back. Before, beat sent its reaper to the exec queue, which no worker of this fleet consumed: the
    call stayed executing, its credit held, until its timeout ended it tool_timeout."""
    with own_deployment(stack_env, "tools-only", beat=True, exec_worker=False) as fleet:
        username = f"tools-only-{free_port()}"
        api = Api(fleet.base_url, api_key(fleet.env, username, credits=10), username)
        answers: list[httpx.Response] = []
        body = {"toolset": "demo", "tool": "sleep", "arguments": {"ms": 50_000}}

        def call() -> None:
            answers.append(api.post("/api/v1/tools/execute", json=body, timeout=120))

        calling = threading.Thread(target=call, daemon=True)
        calling.start()
        call_id = _claimed_call(fleet.env["DATABASE_URL"], username, 30)
        assert api.get("/api/v1/billing/balance").json()["reserved"] == 1  # its price, held
        fleet.tools_worker.kill()
        fleet.tools_worker.start()  # the fleet: this tools worker and beat
        calling.join(90)  # the lease (4 s) and a reaper's round (1 s); its tool's timeout is 60 s
        assert answers, "the call was never answered"
        assert answers[0].status_code == 200, answers[0].text
        call = answers[0].json()
        assert (call["call_id"], call["status"], call["error"]["code"]) == (call_id, "failed", "worker_lost"), call
        deadline = time.monotonic() + 30
        while (balance := api.get("/api/v1/billing/balance").json())["reserved"]:
            assert time.monotonic() < deadline, f"its price is still held: {balance}"
            time.sleep(0.1)
        assert balance["balance"] == 10  # released, not charged
        api.http.close()
