"""Behind PgBouncer in transaction mode, as many production databases are reached (README, "Behind
PgBouncer"): a client's session lasts one transaction, and what a session sets stays on the server
connection the pooler lent it, for whichever client comes next."""

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests.conftest import REDIS_PREFIX, TEST_DATABASE_URL, Api
from tests.servers import PgBouncer, api_key, database_drop, migrated_database
from tests.stack import ROOT, Stack, free_port


@pytest.fixture(scope="module")
def pooled(stack_env: dict[str, str]) -> Iterator[tuple[Stack, str]]:
    """A deployment whose every process reaches PostgreSQL through PgBouncer (its prepared
    statements off, as PgBouncer before 1.22 needs), migrated on a direct connection, as the README
    says. Yields the stack and its database's direct URL."""
    bouncer = PgBouncer(TEST_DATABASE_URL, pool_size=8)
    own = {**stack_env, "PTC_REDIS_PREFIX": f"{REDIS_PREFIX}pooled:", "PTC_DB_PREPARE_AFTER": "0", "PTC_DB_POOL_MIN": "1"}
    direct = ""
    stack = None
    try:
        bouncer.start()
        direct = migrated_database(TEST_DATABASE_URL, own)
        own["DATABASE_URL"] = bouncer.url(direct.rsplit("/", 1)[1])
        stack = Stack(own, name="pooled")
        stack.start(beat=False)
        yield stack, direct
    finally:
        if stack is not None:
            stack.stop()
        if direct:
            database_drop(direct)
        bouncer.stop()


def test_jobs_calls_and_their_charges_run_behind_pgbouncer(pooled: tuple[Stack, str]) -> None:
    stack, _ = pooled
    username = f"pooled-{free_port()}"
    api = Api(stack.base_url, api_key(stack.env, username, credits=100), username)
    code = """
from concurrent.futures import ThreadPoolExecutor
from ptc_tools.demo import Demo
total = sum(Demo.add(a=i, b=1) for i in range(5))
with ThreadPoolExecutor(8) as pool:
    total += sum(pool.map(lambda i: Demo.add(a=i, b=0), range(16)))
total
"""
    job = api.run(code, toolsets=["demo"])
    assert job["status"] == "completed", job["error"]
    assert job["return_value"] == sum(range(1, 6)) + sum(range(16))
    calls = api.get("/api/v1/tool-calls", params={"exec": job["id"], "page_size": 100}).json()["results"]
    assert len(calls) == 21 and {call["status"] for call in calls} == {"completed"}
    # Demo.add costs 1 credit a call: each charged once, the ledger exact.
    assert api.get("/api/v1/billing/balance").json()["balance"] == 100 - 21
    check = subprocess.run(
        [sys.executable, "manage.py", "check_ledger"], cwd=ROOT, env=stack.env, capture_output=True, text=True, timeout=120
    )
    assert check.returncode == 0, check.stderr[-800:]


# Work that may rightly run long (the retention purge, check_ledger) runs without the statement
# timeout. Its process's pool sets PTC_DB_STATEMENT_TIMEOUT (1 s here) on each connection it makes,
# which PgBouncer (one server connection here) passes to its server connection. Printed: whether
# the block's statement longer than the timeout ran, and the timeout another client of the pooler
# sees, while the block runs and after.
_TIMEOUT_LIFTED = """
import sys
import django
django.setup()
import psycopg
from django.db import connection
from ptcproject.db import statement_timeout_off

with connection.cursor() as cursor:
    cursor.execute("SELECT 1")
other = psycopg.connect(sys.argv[1], autocommit=True)
with statement_timeout_off():
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_sleep(1.5)")
    print("ran", other.execute("SHOW statement_timeout").fetchone()[0])
print(other.execute("SHOW statement_timeout").fetchone()[0])
"""


def test_work_run_without_the_statement_timeout_leaves_every_other_client_its_timeout(
    django_db_setup: str,
) -> None:
    # The timeout was lifted by a session's SET, which stayed on the pooler's server connection: a
    # client of the pooler meanwhile ran without any timeout, and (with more server connections) the
    # block's own next statement could go to one with the timeout, and be cancelled.
    bouncer = PgBouncer(TEST_DATABASE_URL, pool_size=1)
    bouncer.start()
    try:
        url = bouncer.url(django_db_setup.rsplit("/", 1)[1])
        env = {**os.environ, "DATABASE_URL": url, "PTC_DB_STATEMENT_TIMEOUT": "1", "PTC_DB_PREPARE_AFTER": "0"}
        run = subprocess.run(
            [sys.executable, "-c", _TIMEOUT_LIFTED, url], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
        )
    finally:
        bouncer.stop()
    assert run.returncode == 0, run.stderr[-800:]
    assert run.stdout.split("\n")[:2] == ["ran 1s", "1s"]
