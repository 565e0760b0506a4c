"""The connection pool hands out a connection used a moment ago without a round trip, and checks
one that sat in the pool a while: after a restart that one is replaced, not given to a query."""

import os
import subprocess
import sys
import time
import uuid

import psycopg
import pytest
from django.db import connection

from ptcproject import pgcheck
from tests.stack import ROOT


def test_the_pool_uses_our_check(django_db_setup: str) -> None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
    assert connection.pool._check is pgcheck.check_unless_recent


def test_a_connection_idle_a_while_is_checked_a_recent_one_is_trusted(django_db_setup: str) -> None:
    conn = psycopg.connect(django_db_setup, autocommit=True)
    try:
        pgcheck.check_unless_recent(conn)  # new to the pool: checked, and fine
        with psycopg.connect(django_db_setup, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", [conn.info.backend_pid])
        # Handed out a moment ago: no round trip, so the dead backend is not noticed here...
        pgcheck.check_unless_recent(conn)
        # ...but once it has sat in the pool a while, it is checked, and refused.
        pgcheck._last_out[conn] = time.monotonic() - 2 * pgcheck.CHECK_AFTER
        with pytest.raises(psycopg.OperationalError):
            pgcheck.check_unless_recent(conn)
        with pytest.raises(ConnectionError):  # known broken now: refused without a round trip
            pgcheck.check_unless_recent(conn)
    finally:
        conn.close()


def test_a_prepared_statement_survives_a_migration_that_changes_its_columns(django_db_setup: str) -> None:
    # A rolling deploy migrates while workers run: their prepared statements must not fail for as
    # long as their pooled connections live.
    table = f"scratch_{uuid.uuid4().hex[:8]}"
    with connection.cursor() as cursor:
        cursor.execute(f"CREATE TABLE {table} (id int, title varchar(10))")
        try:
            cursor.execute(f"INSERT INTO {table} VALUES (1, 'a')")
            for _ in range(8):  # past the threshold: prepared on this connection
                cursor.execute(f"SELECT id, title FROM {table} WHERE id = %s", [1])
            assert cursor.connection.info.transaction_status.name == "IDLE"
            with psycopg.connect(django_db_setup, autocommit=True) as admin:  # another process's migration
                admin.execute(f"ALTER TABLE {table} ALTER COLUMN title TYPE varchar(200)")
            cursor.execute(f"SELECT id, title FROM {table} WHERE id = %s", [1])
            assert cursor.fetchall() == [(1, "a")]
        finally:
            cursor.execute(f"DROP TABLE {table}")


def test_migrations_run_at_once_on_a_new_database_wait_for_each_other() -> None:
    """Each web replica migrates before it starts (deploy/kubernetes/web.yaml): three at once on a
    new database each made its first tables, and all but one failed on a duplicate key."""
    name = f"ptc_migrate_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(os.environ["TEST_DATABASE_URL"], autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        env = {**os.environ, "DATABASE_URL": f"{os.environ['TEST_DATABASE_URL'].rsplit('/', 1)[0]}/{name}"}
        argv = [sys.executable, "manage.py", "migrate", "--no-input", "-v0"]
        runs = [subprocess.Popen(argv, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True) for _ in range(3)]
        outcomes = [(run.wait(timeout=180), run.stderr.read() if run.stderr else "") for run in runs]
        assert [code for code, _ in outcomes] == [0, 0, 0], [said[-300:] for _, said in outcomes]
    finally:
        with psycopg.connect(os.environ["TEST_DATABASE_URL"], autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def test_a_concurrent_index_is_built_while_migrate_holds_its_lock(django_db_setup: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A migration may build an index with CREATE INDEX CONCURRENTLY (atomic = False), which waits
    for every transaction holding a snapshot. migrate's lock is a transaction's, open for the whole
    run: it held one, and such a migration waited for ever."""
    from django.core.management import call_command
    from django.core.management.commands.migrate import Command as DjangoMigrate

    table = f"scratch_{uuid.uuid4().hex[:8]}"
    built = []

    def migrating(*args: object, **options: object) -> None:  # what a migration would run, in its place
        with psycopg.connect(django_db_setup, autocommit=True) as other:
            other.execute("SET statement_timeout = '10s'")
            other.execute(f"CREATE TABLE {table} (id int)")
            try:
                other.execute(f"CREATE INDEX CONCURRENTLY {table}_id ON {table} (id)")
                built.append(table)
            finally:
                other.execute(f"DROP TABLE {table}")

    monkeypatch.setattr(DjangoMigrate, "handle", migrating)
    call_command("migrate")
    assert built == [table]


@pytest.mark.parametrize(
    ("app", "before", "index", "build"),
    [
        ("execution", "0012", "execjob_created", "ON execution_execjob (created_at DESC)"),
        (
            "billing",
            "0004",
            "ledger_once_per_idempotency_key",
            "ON billing_ledgerentry (account_id, idempotency_key) WHERE idempotency_key IS NOT NULL",
        ),
    ],
)
def test_an_index_a_cut_off_concurrent_build_left_invalid_is_built_again_by_the_next_migrate(
    app: str, before: str, index: str, build: str
) -> None:
    """An index on a busy table (jobs, the ledger) is built concurrently: its rows go on being
    written meanwhile. A build cut off (a deploy's timeout, a cancelled statement) leaves the index
    behind, invalid, and the migration unrecorded: the next migrate must build it again, not fail on
    the name being taken."""
    name = f"ptc_migrate_{uuid.uuid4().hex[:8]}"
    server = os.environ["TEST_DATABASE_URL"].rsplit("/", 1)[0]
    with psycopg.connect(os.environ["TEST_DATABASE_URL"], autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        env = {**os.environ, "DATABASE_URL": f"{server}/{name}"}

        def migrate(*target: str) -> None:
            argv = [sys.executable, "manage.py", "migrate", "--no-input", "-v0", *target]
            run = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
            assert run.returncode == 0, run.stderr[-600:]

        def valid() -> list[bool]:
            with psycopg.connect(f"{server}/{name}") as conn:
                found = conn.execute(
                    "SELECT i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid WHERE c.relname = %s", [index]
                )
                return [row[0] for row in found.fetchall()]

        migrate()
        assert valid() == [True]
        migrate(app, before)
        assert valid() == []
        # A build cut off: it waits for a transaction older than it, and its statement times out.
        with psycopg.connect(f"{server}/{name}") as older, psycopg.connect(f"{server}/{name}", autocommit=True) as cut:
            older.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            older.execute("SELECT 1")
            cut.execute("SET statement_timeout = '1s'")
            with pytest.raises(psycopg.errors.QueryCanceled):
                cut.execute(f"CREATE {'UNIQUE ' if app == 'billing' else ''}INDEX CONCURRENTLY {index} {build}")
            older.rollback()
        assert valid() == [False]
        migrate()
        assert valid() == [True]
    finally:
        with psycopg.connect(os.environ["TEST_DATABASE_URL"], autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _statement_timeout() -> str:
    """The connection's statement_timeout and lock_timeout, as "30s/30s": PTC_DB_STATEMENT_TIMEOUT
    sets both (a foreign key's check at the commit is past the statement's clock, not a lock's)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT current_setting('statement_timeout') || '/' || current_setting('lock_timeout')")
        return str(cursor.fetchone()[0])


def test_pooled_connections_have_the_statement_timeout_and_migrate_runs_without_it(
    django_db_setup: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from django.core.management import call_command
    from django.core.management.commands.migrate import Command as DjangoMigrate

    during = []
    monkeypatch.setattr(DjangoMigrate, "handle", lambda *args, **options: during.append(_statement_timeout()))
    assert _statement_timeout() == "30s/30s"  # PTC_DB_STATEMENT_TIMEOUT's default
    call_command("migrate")
    assert during == ["0/0"]
    assert _statement_timeout() == "30s/30s"  # and set again after it, on a connection the process goes on using


@pytest.mark.parametrize("work", ["retention", "check_ledger"])
def test_work_that_may_rightly_run_long_runs_without_the_statement_timeout(
    django_db_setup: str, monkeypatch: pytest.MonkeyPatch, work: str
) -> None:
    # A retention round empties up to 500 jobs' calls in one statement, and check_ledger sums the
    # whole ledger: on a large database either may pass 30 s, and cut off, the purge would fail on
    # the same batch at every round.
    from django.core.management import call_command

    from billing.management.commands import check_ledger
    from execution.services import retention

    during: list[str] = []
    if work == "retention":
        monkeypatch.setattr(retention, "event_logs_expire", lambda: during.append(_statement_timeout()))
        retention.exec_jobs_purge()
    else:
        monkeypatch.setattr(check_ledger, "ledger_mismatches", lambda: during.append(_statement_timeout()) or [])
        call_command("check_ledger")
    assert during == ["0/0"]
    assert _statement_timeout() == "30s/30s"


def test_a_connection_lost_under_work_run_without_the_statement_timeout_is_an_outage_error(django_db_setup: str) -> None:
    # The timeout is lifted by a SET LOCAL that opens each transaction of such work: the statement
    # that finds a connection lost (its backend killed, a restart). It was sent past Django's error
    # translation: psycopg's own AdminShutdown came out, which no outage path (db_retry, the API's
    # 503) knows.
    from django.db import OperationalError

    from ptcproject.db import statement_timeout_off

    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        pid = cursor.fetchone()[0]
    with psycopg.connect(django_db_setup, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", [pid])
    with pytest.raises(OperationalError) as raised, statement_timeout_off(), connection.cursor() as cursor:
        cursor.execute("SELECT 1")
    assert isinstance(raised.value.__cause__, psycopg.OperationalError)
    with statement_timeout_off(), connection.cursor() as cursor:  # the next one is a good connection
        cursor.execute("SHOW statement_timeout")
        assert cursor.fetchone()[0] == "0"
    assert _statement_timeout() == "30s/30s"


def test_a_worker_retrying_a_cancelled_statement_says_it_was_cancelled_not_unreachable(
    django_db_setup: str, caplog: pytest.LogCaptureFixture
) -> None:
    from ptcproject.db import db_retry

    tries: list[int] = []

    def work() -> int:
        tries.append(1)
        with connection.cursor() as cursor:
            if len(tries) == 1:  # the first try is cancelled, as PTC_DB_STATEMENT_TIMEOUT cancels
                cursor.execute("SET statement_timeout = '10ms'")
                try:
                    cursor.execute("SELECT pg_sleep(1)")
                finally:
                    cursor.execute("SET statement_timeout = '30s'")
            cursor.execute("SELECT 1")
            return int(cursor.fetchone()[0])

    with caplog.at_level("WARNING", logger="ptc.db"):
        assert db_retry(work, what="claiming a job", job_id="j") == 1
    assert len(tries) == 2
    [said] = [record.getMessage() for record in caplog.records if record.name == "ptc.db"]
    assert said.startswith("a statement was cancelled (statement or lock timeout) while claiming a job"), said


# A process whose statement waits on a row another transaction holds locked (a stuck admin action, a
# migration's ALTER TABLE): with PTC_DB_STATEMENT_TIMEOUT=1 it is cancelled, as an OperationalError.
_WAITING_ON_A_LOCK = """
import time
import django
django.setup()
from django.db import OperationalError, transaction
from ptcproject.policy.models import Policy

began = time.monotonic()
try:
    with transaction.atomic():
        Policy.objects.select_for_update().first()
except OperationalError as exc:
    print(type(exc.__cause__).__name__, round(time.monotonic() - began, 1))
"""


def test_a_statement_waiting_on_a_lock_is_cancelled_at_the_statement_timeout(django_db_setup: str) -> None:
    from ptcproject.policy.models import Policy

    table = Policy._meta.db_table
    with psycopg.connect(django_db_setup) as holder:
        holder.execute(f"SELECT * FROM {table} FOR UPDATE")  # held, its transaction open, for the test
        env = {**os.environ, "DATABASE_URL": django_db_setup, "PTC_DB_STATEMENT_TIMEOUT": "1"}
        run = subprocess.run(
            [sys.executable, "-c", _WAITING_ON_A_LOCK], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
        )
        holder.rollback()
    assert run.returncode == 0, run.stderr[-600:]
    cancelled, after = run.stdout.split()
    assert cancelled == "QueryCanceled"
    assert 0.9 <= float(after) < 5


def test_a_connection_of_its_own_keeps_the_database_urls_options(django_db_setup: str) -> None:
    """migrate's lock and manage.py's reason for an unreachable database connect apart from the pool:
    with the options of DATABASE_URL (?sslmode=verify-full&sslrootcert=..., ?options=...) as the pool
    has them, not libpq's defaults (sslmode=prefer: no certificate checked, the password sent anyway)."""
    from ptcproject.db import pg_connect

    options = connection.settings_dict["OPTIONS"]
    options["application_name"] = "ptc-own-connection"
    try:
        with pg_connect() as conn:
            assert conn.execute("SHOW application_name").fetchone() == ("ptc-own-connection",)
    finally:
        del options["application_name"]


# A process asking for a connection every 0.3 s through an outage: when it is served again.
_THROUGH_AN_OUTAGE = """
import time
import django
django.setup()
from django.db import DatabaseError, connection

def served():
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
        return True
    except DatabaseError:
        return False
    finally:
        connection.close()

assert served()
print("up", flush=True)
while served():
    time.sleep(0.3)
while not served():
    time.sleep(0.3)
print(time.time(), flush=True)
"""


def test_the_pool_serves_again_within_a_second_or_two_of_postgresql_being_back() -> None:
    # A connection the pool could not make was tried again after 1, 2, 4, 8 s..., and none other
    # made meanwhile for the requests waiting: after 20 s down, every request failed for 7-9 s more
    # after PostgreSQL was back (after a minute, up to a minute more).
    from tests.servers import PostgresServer

    pg = PostgresServer()
    pg.start()
    try:
        env = {**os.environ, "DATABASE_URL": pg.url(), "PTC_DB_POOL_TIMEOUT": "1"}
        probe = subprocess.Popen(
            [sys.executable, "-c", _THROUGH_AN_OUTAGE],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        assert probe.stdout is not None
        try:
            assert probe.stdout.readline().strip() == "up"
            pg.stop()
            time.sleep(20)
            pg.start()
            back = time.time()
            lag = float(probe.stdout.readline()) - back
        finally:
            probe.kill()
            probe.wait()
        assert lag < 2.5, f"the pool served again {lag:.1f} s after PostgreSQL was back"
    finally:
        pg.remove()
