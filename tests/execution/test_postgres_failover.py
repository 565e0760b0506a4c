"""A failover that leaves the pools' connections on a server that is now read-only (Aurora's, or
Patroni's, demoting the old primary): the API says 503 rather than 500, the connections to it are
replaced, and the next job runs, its worker retrying as through an outage.

It runs its own PostgreSQL, which it makes read-only under the stack's open connections and
writable to new ones: a demoted primary behind connections, a new one behind the address."""

import time
from collections.abc import Iterator

import httpx
import psycopg
import pytest

from tests.conftest import REDIS_PREFIX
from tests.servers import PostgresServer, api_key, migrated_database
from tests.stack import Stack


@pytest.fixture
def failing_over(stack_env: dict[str, str]) -> Iterator[tuple[PostgresServer, Stack]]:
    server = PostgresServer()
    env = {**stack_env, "PTC_REDIS_PREFIX": f"{REDIS_PREFIX}failover:", "PTC_DB_RETRY_SECONDS": "30"}
    stack = None
    try:
        server.start()
        env["DATABASE_URL"] = migrated_database(server.url(), env)
        stack = Stack(env, name="pg-failover")
        stack.start(beat=False)
        yield server, stack
    finally:
        if stack is not None:
            stack.stop()
        server.remove()


def _fail_over(server: PostgresServer, database: str) -> None:
    """Every session open now goes read-only; every one opened after is writable."""
    with psycopg.connect(server.url(), autocommit=True) as admin:
        admin.execute(f'ALTER DATABASE "{database}" SET default_transaction_read_only = off')
        admin.execute("ALTER SYSTEM SET default_transaction_read_only = on")
        admin.execute("SELECT pg_reload_conf()")
    time.sleep(0.5)  # every backend has read its configuration again


def test_after_a_failover_to_a_read_only_server_the_api_says_503_and_the_next_job_runs(
    failing_over: tuple[PostgresServer, Stack],
) -> None:
    server, stack = failing_over
    http = httpx.Client(
        base_url=stack.base_url, headers={"Authorization": f"Bearer {api_key(stack.env, 'failover')}"}, timeout=60
    )
    code = "from ptc_tools.demo import Demo\nDemo.add(a=1, b=2)"
    assert http.post("/api/v1/exec", json={"code": code, "toolsets": ["demo"], "wait": 30}).json()["return_value"] == 3
    _fail_over(server, stack.env["DATABASE_URL"].rsplit("/", 1)[1])

    # The web's connections reach the read-only server: its write refused, a 503 saying so, not a 500.
    refused = http.post("/api/v1/exec", json={"code": code, "toolsets": ["demo"], "wait": 30})
    assert refused.status_code == 503, refused.text
    error = refused.json()["error"]
    assert error["code"] == "database_unavailable" and "read-only" in error["message"], error
    assert refused.headers["Retry-After"]

    # Retried, as the client is told: the web's connections were replaced, and the workers' (each
    # refused on its own first write: the claim, the call's record) are retried as an outage's are.
    after = http.post("/api/v1/exec", json={"code": code, "toolsets": ["demo"], "wait": 30})
    assert after.status_code == 201 and after.json()["status"] == "completed", after.text
    assert after.json()["return_value"] == 3
    jobs = http.get("/api/v1/exec").json()["results"]
    assert [job["status"] for job in jobs] == ["completed", "completed"]  # the refused submit left none
    assert http.get("/api/v1/billing/balance").json()["balance"] == 1000 - 2  # each Demo.add charged once
    assert [(process.name, process.proc.poll()) for process in stack.processes if process.proc] == [
        (process.name, None) for process in stack.processes if process.proc
    ]
