"""Fixed statements run together (``rows.together``): on PostgreSQL in one round trip, giving
what each gives alone; an error in one undoes them all; elsewhere one after another."""

import os
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import DataError, connection, connections

from ptcproject import rows
from ptcproject.db import BRIEF_LOCK_WAIT_MS, unless_locked
from ptcproject.policy.selectors import policy_read, quotas_read
from tools.selectors import toolset_keys_read


@pytest.fixture
def scratch() -> Iterator[str]:
    table = f"scratch_{uuid.uuid4().hex[:8]}"
    with connection.cursor() as cursor:
        cursor.execute(f"CREATE TABLE {table} (id int, title varchar(10))")
    yield table
    with connection.cursor() as cursor:
        cursor.execute(f"DROP TABLE {table}")


def _sent_and_read(run: Callable[[], object]) -> list[str]:
    """The protocol messages the connection sent (``F``) and read (``B``) while ``run`` ran, in order."""
    with connection.cursor():  # the connection taken from the pool first: its check is not traced
        pass
    pgconn = connection.connection.pgconn
    with tempfile.TemporaryFile("w+") as trace:
        pgconn.trace(trace.fileno())
        pgconn.set_trace_flags(psycopg.pq.Trace.SUPPRESS_TIMESTAMPS)
        try:
            run()
        finally:
            pgconn.untrace()
        os.lseek(trace.fileno(), 0, os.SEEK_SET)
        return [line.split("\t")[0] + " " + line.split("\t")[2].split()[0] for line in trace.read().splitlines()]


def _statements() -> tuple[rows.Statement[Any], rows.Statement[Any], rows.Statement[Any]]:
    """The web's reads for a submit: the policy, the toolsets and a new user's quotas."""
    user = get_user_model().objects.create_user(username=f"rows-{uuid.uuid4().hex[:8]}")
    return policy_read(), toolset_keys_read(user=user, keys=None), quotas_read(user=user)


def test_statements_together_go_in_one_round_trip() -> None:
    statements = _statements()
    together = _sent_and_read(lambda: rows.together(*statements))
    executes = [i for i, message in enumerate(together) if message == "F Execute"]
    replies = [i for i, message in enumerate(together) if message.startswith("B ")]
    assert len(executes) == 3
    assert max(executes) < min(replies), together  # all sent before the first reply is read
    # Alone, each waits for its reply before the next is sent: what the check above tells apart.
    alone = _sent_and_read(lambda: [statement.run() for statement in statements])
    executes = [i for i, message in enumerate(alone) if message == "F Execute"]
    assert len(executes) == 3
    assert any(message.startswith("B ") for message in alone[executes[0] : executes[1]]), alone


@pytest.mark.parametrize("vendor", ["postgresql", "sqlite"])
def test_statements_together_give_what_each_gives_alone(vendor: str, monkeypatch: pytest.MonkeyPatch) -> None:
    statements = _statements()
    alone = [statement.run() for statement in statements]
    # Elsewhere than PostgreSQL they run one after another, each alone.
    monkeypatch.setattr(connections["default"], "vendor", vendor)
    for _ in range(8):  # before and after PostgreSQL prepares them (PTC_DB_PREPARE_AFTER)
        assert list(rows.together(*statements)) == alone
    nothing = toolset_keys_read(user=get_user_model()(pk=0), keys=[])  # asks nothing
    policy, keys = rows.together(statements[0], nothing)
    assert (policy, keys) == (alone[0], [])


def test_an_error_in_statements_together_undoes_them_all(scratch: str) -> None:
    written = rows.Statement(f"INSERT INTO {scratch} VALUES (1, 'a') RETURNING id", [], lambda found: found)
    failing = rows.Statement("SELECT 1 / %s", [0], lambda found: found)
    connection.ensure_connection()
    held = connection.connection
    with pytest.raises(DataError):  # Django's, as a query alone raises it
        rows.together(written, failing)
    assert held.closed  # not given back to the pool: its prepared statements may be wrong (below)
    count = rows.Statement(f"SELECT count(*) FROM {scratch}", [], lambda found: found[0][0])
    assert count.run() == 0  # the INSERT went with the failed read
    assert rows.together(written, count) == ([(1,)], 1)  # and the connection serves on


def test_a_prepared_statement_together_survives_a_migration_that_changes_its_columns(django_db_setup: str, scratch: str) -> None:
    read = rows.Statement(f"SELECT id, title FROM {scratch} WHERE id = %s", [1], lambda found: found)
    policy = policy_read()
    rows.Statement(f"INSERT INTO {scratch} VALUES (1, 'a') RETURNING id", [], lambda found: found).run()
    for _ in range(8):  # past the threshold: prepared on this connection
        rows.together(read, policy)
    with psycopg.connect(django_db_setup, autocommit=True) as admin:  # another process's migration
        admin.execute(f"ALTER TABLE {scratch} ALTER COLUMN title TYPE varchar(200)")
    found, _ = rows.together(read, policy)
    assert found == [(1, "a")]


def test_a_statement_due_to_be_prepared_in_a_round_trip_that_failed_before_it_runs_after() -> None:
    # PostgreSQL skips what follows an error in a pipeline, the Parse psycopg sent to prepare a
    # statement on its PTC_DB_PREPARE_AFTER-th run too; psycopg took it as prepared all the same,
    # and it failed ever after on that connection ("prepared statement _pg3_N does not exist").
    failing = rows.Statement("SELECT 1 / %s", [0], lambda found: found)
    for runs in range(settings.PTC_DB_PREPARE_AFTER + 3):  # which of its runs fails: each, in turn
        read = rows.Statement(f"SELECT %s::int + {runs}", [1], lambda found: found)
        for _ in range(runs):
            rows.together(read, policy_read())
        with pytest.raises(DataError):
            rows.together(failing, read)
        for _ in range(3):
            assert rows.together(read, policy_read())[0] == [(runs + 1,)]
            assert read.run() == [(runs + 1,)]


def test_statements_together_in_work_that_waits_on_a_lock_briefly_go_in_one_round_trip_all_or_nothing(
    django_db_setup: str, scratch: str
) -> None:
    """Statements together in a reaper's item (``unless_locked``: each transaction waits on a lock
    briefly) wait so, in one round trip, and are still all or nothing: one that waited on a row held
    locked, cancelled, undoes the others. Before, each went in a transaction of its own, its own
    round trips: the first was committed though the second was cancelled."""
    with connection.cursor() as cursor:
        cursor.execute(f"INSERT INTO {scratch} VALUES (1, 'a'), (2, 'a')")
    free = rows.Statement(f"UPDATE {scratch} SET title = 'b' WHERE id = 2 RETURNING id", [], lambda found: found)
    held = rows.Statement(f"UPDATE {scratch} SET title = 'b' WHERE id = 1 RETURNING id", [], lambda found: found)
    wait = rows.Statement("SELECT current_setting('lock_timeout')", [], lambda found: found[0][0])
    sent = _sent_and_read(lambda: unless_locked(lambda: rows.together(held, wait), what="a test"))
    executes = [i for i, message in enumerate(sent) if message == "F Execute"]
    assert executes and max(executes) < min(i for i, message in enumerate(sent) if message.startswith("B ")), sent
    with connection.cursor() as cursor:
        cursor.execute(f"UPDATE {scratch} SET title = 'a'")
    with psycopg.connect(django_db_setup) as holder:
        holder.execute(f"SELECT 1 FROM {scratch} WHERE id = 1 FOR UPDATE")  # a transaction stuck elsewhere
        began = time.monotonic()
        assert unless_locked(lambda: rows.together(free, wait, held), what="a test") is None
        assert time.monotonic() - began < 5  # BRIEF_LOCK_WAIT_MS, not PTC_DB_STATEMENT_TIMEOUT (30 s)
        holder.rollback()
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT id, title FROM {scratch} ORDER BY id")
        assert cursor.fetchall() == [(1, "a"), (2, "a")]  # the free row's UPDATE undone with the one cancelled
    assert unless_locked(lambda: rows.together(free, wait), what="a test") == ([(2,)], f"{BRIEF_LOCK_WAIT_MS}ms")
