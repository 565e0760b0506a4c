"""PostgreSQL going away under a running stack: jobs end, nothing is left running, the API says 503.

These tests run their own PostgreSQL and their own stack on it, so they can stop it at will.
"""

import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import psycopg
import pytest

from tests.conftest import REDIS_PREFIX
from tests.servers import PostgresServer, api_key, migrated_database
from tests.stack import Stack, process_names


@pytest.fixture(scope="module")
def pg() -> Iterator[PostgresServer]:
    server = PostgresServer()
    server.start()
    try:
        yield server
    finally:
        server.remove()


@pytest.fixture(scope="module")
def pg_stack(pg: PostgresServer, stack_env: dict[str, str]) -> Iterator[Stack]:
    # Its own queues and channels on the shared Redis: the suite's workers must not take its jobs.
    env = {**stack_env, "PTC_REDIS_PREFIX": f"{REDIS_PREFIX}pg:", "PTC_DB_RETRY_SECONDS": "60"}
    env["DATABASE_URL"] = migrated_database(pg.url(), env)
    stack = Stack(env, name="pg-outage")
    try:
        stack.start(beat=False)  # the exec worker's own reaper is enough
        yield stack
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def http(pg_stack: Stack) -> httpx.Client:
    key = api_key(pg_stack.env, "outage")
    return httpx.Client(base_url=pg_stack.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def _final(http: httpx.Client, job_id: str, seconds: float) -> dict[str, Any]:
    deadline = time.monotonic() + seconds
    while True:
        response = http.get(f"/api/v1/exec/{job_id}")
        if response.status_code == 200 and response.json()["status"] not in ("queued", "running"):
            return response.json()
        assert time.monotonic() < deadline, f"the job did not end within {seconds} s: {response.text}"
        time.sleep(0.2)


def _wait_running(http: httpx.Client, job_id: str) -> None:
    deadline = time.monotonic() + 15
    while http.get(f"/api/v1/exec/{job_id}").json()["status"] != "running":
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_a_restart_mid_job_is_survived(pg: PostgresServer, http: httpx.Client) -> None:
    code = """
import time
from ptc_tools.demo import Demo
print("before", Demo.add(a=1, b=1))
time.sleep(5)
print("after")
Demo.add(a=2, b=2)
"""
    job = http.post("/api/v1/exec", json={"code": code, "toolsets": ["demo"]}).json()
    _wait_running(http, job["id"])
    time.sleep(1)
    pg.stop()
    time.sleep(2)
    pg.start()
    final = _final(http, job["id"], 60)
    assert final["status"] == "completed", final["error"]
    assert final["return_value"] == 4
    assert final["stdout"] == "before 2\nafter\n"
    assert [c["status"] for c in final["tool_calls"]] == ["completed", "completed"]


def test_a_job_that_ends_while_postgres_is_down_is_recorded_when_it_is_back(pg: PostgresServer, http: httpx.Client) -> None:
    # Its runner names itself: its sandbox, done with, is killed while its end waits for the database.
    name = f"ptc-out-{uuid.uuid4().hex[:6]}"
    code = f"import time\nprint('kept')\nopen('/proc/self/comm', 'w').write({name!r})\ntime.sleep(1)\n'done'"
    job = http.post("/api/v1/exec", json={"code": code}).json()
    _wait_running(http, job["id"])
    pg.stop()
    time.sleep(5)  # the job ends meanwhile; its worker keeps trying to record that
    assert name not in process_names()
    pg.start()
    final = _final(http, job["id"], 60)
    assert final["status"] == "completed", final["error"]
    assert final["stdout"] == "kept\n"
    assert final["return_value"] == "done"


def test_a_job_accepted_before_an_outage_runs_when_postgres_is_back(
    pg: PostgresServer, pg_stack: Stack, http: httpx.Client
) -> None:
    pg_stack.exec_worker.stop()
    job = http.post("/api/v1/exec", json={"code": "'ran'", "toolsets": ["demo"]}).json()
    assert job["status"] == "queued"
    pg.stop()
    pg_stack.exec_worker.start()  # takes the message; its claim can't reach the database
    time.sleep(3)
    pg.start()
    final = _final(http, job["id"], 60)
    assert final["status"] == "completed", final["error"]
    assert final["return_value"] == "ran"


def test_while_postgres_is_down_the_api_answers_503_at_once(pg: PostgresServer, pg_stack: Stack, http: httpx.Client) -> None:
    pg.stop()
    try:
        for method, path, body in [("GET", "/api/v1/exec", None), ("POST", "/api/v1/exec", {"code": "1"})]:
            started = time.monotonic()
            response = http.request(method, path, json=body)
            assert time.monotonic() - started < 4, f"{method} {path} took too long"
            assert response.status_code == 503, response.text
            assert response.json()["error"]["code"] == "database_unavailable"
        started = time.monotonic()
        ready = httpx.get(f"{pg_stack.base_url}/readyz", timeout=10)
        assert time.monotonic() - started < 2.5
        assert ready.status_code == 503
        assert "database" in ready.json()["error"]["details"]
    finally:
        pg.start()
    deadline = time.monotonic() + 30
    while (again := http.post("/api/v1/exec", json={"code": "'back'", "wait": 20})).status_code != 201:
        assert time.monotonic() < deadline, again.text
        time.sleep(0.5)
    assert again.json()["return_value"] == "back"


def test_submits_cut_while_the_policy_is_locked_leave_the_web_serving(pg_stack: Stack, http: httpx.Client) -> None:
    # A migration holds the policy's table; each submit's reads, sent together in one round trip,
    # wait for it until cancelled (a statement timeout, an operator). Each is a 503; once the lock
    # is gone every submit is taken, whichever of the web's pooled connections serves it.
    url = pg_stack.env["DATABASE_URL"]
    for _ in range(4):  # each of the web's pooled connections has run them before
        assert http.post("/api/v1/exec", json={"code": "1"}).status_code == 201
    with psycopg.connect(url, autocommit=True) as admin, psycopg.connect(url) as holder:
        holder.execute("LOCK TABLE policy_policy IN ACCESS EXCLUSIVE MODE")
        for _ in range(20):  # past PTC_DB_PREPARE_AFTER runs on each of the web's connections
            with ThreadPoolExecutor(1) as pool:
                submitted = pool.submit(http.post, "/api/v1/exec", json={"code": "1"})
                while not submitted.done():
                    admin.execute(
                        "SELECT pg_cancel_backend(pid) FROM pg_locks WHERE NOT granted AND relation = 'policy_policy'::regclass"
                    )
                    time.sleep(0.02)
                response = submitted.result()
            assert response.status_code == 503, response.text
            assert response.json()["error"]["code"] == "database_unavailable"
            assert "cancelled the request's statement" in response.json()["error"]["message"]  # not "unreachable"
        holder.rollback()
    for _ in range(20):
        response = http.post("/api/v1/exec", json={"code": "'taken'", "wait": 20})
        assert response.status_code == 201, response.text
        assert response.json()["return_value"] == "taken"


@pytest.mark.parametrize("cap", [{}, {"max_credits": 100}], ids=["free", "under_a_credit_cap"])
def test_calls_made_just_after_the_workers_connections_were_cut_are_recorded(
    pg_stack: Stack, http: httpx.Client, cap: dict[str, int]
) -> None:
    # A connection used within the last second leaves the pool unchecked: the first statement on
    # one whose backend was killed meanwhile fails. A call submitted then is submitted again on a
    # fresh connection, not failed (internal_error, "the call could not be recorded"). Under
    # max_credits a call's first statement (its price known from the job's first call) is the
    # account's lock, inside a transaction: the rollback that follows its failure closes the dead
    # connection, and the submit took that for a database that can't be reached.
    code = "import time\nfrom ptc_tools.demo import Demo\nfor i in range(16):\n    Demo.add(a=i, b=1)\n    time.sleep(0.25)\n'ok'"
    url = pg_stack.env["DATABASE_URL"]
    job = http.post("/api/v1/exec", json={"code": code, "toolsets": ["demo"], **cap}).json()
    _wait_running(http, job["id"])
    with psycopg.connect(url, autocommit=True) as admin:
        for _ in range(4):
            time.sleep(0.6)
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
    final = _final(http, job["id"], 60)
    assert final["status"] == "completed", final["error"]
    assert [c["status"] for c in final["tool_calls"]] == ["completed"] * 16
