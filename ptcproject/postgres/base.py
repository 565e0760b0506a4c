"""Django's PostgreSQL backend, with the pool checking connections as ``ptcproject.pgcheck`` says,
statements prepared where a migration may change what they return, and several statements sent in
one round trip (``DatabaseWrapper.pipelined``, for ``ptcproject.rows.together``).

Django builds the psycopg pool itself and always passes it its own ``check`` (a round trip on every
checkout with CONN_HEALTH_CHECKS, none at all without); this backend swaps in ours.
"""

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from typing import Any

import psycopg
from django.conf import settings
from django.db import DatabaseError, NotSupportedError, OperationalError
from django.db.backends.postgresql.base import DatabaseWrapper as PostgresWrapper
from django.db.backends.postgresql.base import ServerBindingCursor
from django.db.utils import DatabaseErrorWrapper
from django.utils.functional import cached_property
from psycopg import errors, pq

from ptcproject.pgcheck import check_unless_recent

logger = logging.getLogger("ptc.db")


def _stale_plan(exc: errors.FeatureNotSupported) -> bool:
    """Whether PostgreSQL refused a prepared statement whose columns changed type under it (a
    migration altered a column): it fails on that connection until it is deallocated. By the
    code and the server function that raise it, not the message, which the server may translate."""
    return exc.sqlstate == "0A000" and exc.diag.source_function == "RevalidateCachedQuery"


def statement_timeout_set(executor: Any) -> None:
    """Give the session of ``executor`` (a psycopg connection, or a cursor) PTC_DB_STATEMENT_TIMEOUT,
    as its statement_timeout and its lock_timeout; 0: PostgreSQL's own.

    lock_timeout too: a foreign key's check (Django makes them DEFERRABLE INITIALLY DEFERRED) runs
    at the commit, which PostgreSQL runs after it has stopped the statement's clock. A row written
    that names a job (a call's record, a hold) waited for the job's row, held locked by a stuck
    transaction, for as long as it was held, whatever statement_timeout said: a tools worker's
    claim did, and every claim on that worker waited behind it. A lock's wait is timed wherever it is."""
    if settings.PTC_DB_STATEMENT_TIMEOUT:
        timeout = f"{round(settings.PTC_DB_STATEMENT_TIMEOUT * 1000)}ms"
        executor.execute(
            "SELECT set_config('statement_timeout', %s, false), set_config('lock_timeout', %s, false)", [timeout, timeout]
        )
    else:
        executor.execute("RESET statement_timeout")
        executor.execute("RESET lock_timeout")


class PreparedCursor(ServerBindingCursor):
    """Django's server-binding cursor, whose statements PostgreSQL prepares after a few runs
    (``prepare_threshold``). Should a migration change the type of a column one returns, that
    statement would fail on its connection for as long as the connection lives. Outside a
    transaction, it is run again once the connection's prepared statements are dropped (psycopg
    forgets its own on ``DEALLOCATE ALL``); inside one, the error stands, and the rollback that
    follows drops them."""

    # django-stubs declare Django's cursor classes empty: psycopg's Cursor is underneath.
    def execute(self, query: Any, params: Any = None, **kwargs: Any) -> Any:
        try:
            return super().execute(query, params, **kwargs)  # type: ignore[misc]
        except errors.FeatureNotSupported as exc:
            connection: psycopg.Connection[Any] = self.connection  # type: ignore[attr-defined]
            if not _stale_plan(exc) or connection.info.transaction_status != pq.TransactionStatus.IDLE:
                raise
            logger.info("a prepared statement outlived a migration; the connection's are dropped and it is run again")
            connection.execute("DEALLOCATE ALL")
            return super().execute(query, params, **kwargs)  # type: ignore[misc]


class FailoverErrorWrapper(DatabaseErrorWrapper):
    """Django's translation of psycopg's errors, where a write refused because the server is
    read-only is an OperationalError, as a database out of reach is: every path that waits out an
    outage (a worker's retry, the API's 503) then waits out a failover too.

    After a failover (Aurora's, Patroni's) a pool's connections still reach the old primary, now a
    standby, which answers every write so for as long as they live, and passes the pool's check (a
    read). The connection is closed, so the pool discards it, and the pool drained (psycopg_pool's
    ``drain``: the others replaced, those in use as they come back), once per FAILOVER_DRAIN_SECONDS:
    the next try reaches the new primary."""

    FAILOVER_DRAIN_SECONDS = 5.0
    _drained_at = float("-inf")
    _drain_lock = threading.Lock()

    def __exit__(self, exc_type: Any, exc_value: Any, traceback: Any) -> None:
        if exc_type is None or not issubclass(exc_type, errors.ReadOnlySqlTransaction):
            return super().__exit__(exc_type, exc_value, traceback)
        database = self.wrapper  # type: ignore[attr-defined]  # set by Django's __init__, not in the stubs
        database.errors_occurred = True
        if database.connection is not None:
            database.connection.close()
        pool = database.pool
        with self._drain_lock:
            drain = pool is not None and time.monotonic() - FailoverErrorWrapper._drained_at > self.FAILOVER_DRAIN_SECONDS
            if drain:
                FailoverErrorWrapper._drained_at = time.monotonic()
        if drain:
            logger.warning("the database refused a write, read-only (a failover?): its pool's connections are replaced")
            pool.drain()
        raise OperationalError(*exc_value.args).with_traceback(traceback) from exc_value


class DatabaseWrapper(PostgresWrapper):
    @cached_property
    def wrap_database_errors(self) -> FailoverErrorWrapper:
        return FailoverErrorWrapper(self)

    def _configure_connection(self, connection: Any) -> bool:
        """Django's set-up of a new connection (the pool's ``configure``: its time zone, its role),
        and ``PTC_DB_STATEMENT_TIMEOUT``, set for its session: one round trip, once per connection.
        Set so rather than by libpq's ``options`` in the URL, which PgBouncer refuses at connect."""
        commit: bool = super()._configure_connection(connection)  # type: ignore[misc]  # Django 5.1+, not in the stubs
        if settings.PTC_DB_STATEMENT_TIMEOUT:
            statement_timeout_set(connection)
        return commit

    @property
    def pool(self) -> Any:
        pool = super().pool
        if pool is not None and pool._check is not check_unless_recent:
            pool._check = check_unless_recent  # where psycopg_pool keeps it; tests/test_db.py checks it is used
        return pool

    def pipelined(self, statements: Sequence[tuple[str, Sequence[Any] | Mapping[str, Any]]]) -> list[list[tuple[Any, ...]]]:
        """Run ``statements`` (SQL and parameters, each returning rows) in one round trip, psycopg's
        pipeline mode, and return each one's rows. They run in order, outside ``atomic`` as one
        implicit transaction: an error in any undoes them all, and is raised as a query's would be,
        the connection dropped (``_pipeline_failed``).
        A statement whose prepared plan a migration made stale is run again as ``PreparedCursor``
        runs it, the connection's prepared statements dropped, outside a transaction only."""
        try:
            with ExitStack() as stack:
                # Opened first: taking a connection from the pool may check it with a round trip of its own.
                cursors = [stack.enter_context(self.cursor()) for _ in statements]
                try:
                    self._pipeline_run(cursors, statements)
                except NotSupportedError as exc:  # Django's, raised from psycopg's
                    stale = isinstance(exc.__cause__, errors.FeatureNotSupported) and _stale_plan(exc.__cause__)
                    if not stale or self.connection.info.transaction_status != pq.TransactionStatus.IDLE:
                        raise
                    logger.info("a prepared statement outlived a migration; the connection's are dropped and it is run again")
                    self.connection.execute("DEALLOCATE ALL")
                    self._pipeline_run(cursors, statements)
                return [cursor.fetchall() for cursor in cursors]
        except DatabaseError:
            self._pipeline_failed()
            raise

    def _pipeline_failed(self) -> None:
        """Drop the connection a pipeline failed on, outside a transaction: psycopg's record of its
        prepared statements may be wrong.

        psycopg counts a statement as prepared once it has queued its Parse, in a pipeline as well
        (it reads the Parse's result only for a statement it has not seen before on the connection).
        PostgreSQL skips what follows an error in a pipeline, that Parse too: the statement whose
        turn to be prepared it was (its PTC_DB_PREPARE_AFTER-th run), or the one that failed, then
        failed on every later run on the connection, "prepared statement _pg3_N does not exist", a
        500 on each submit it served for as long as the pool kept it. Its prepared statements can't
        be dropped in psycopg alone (DEALLOCATE ALL is read only the first time it is run), so the
        connection goes: psycopg's pool discards a closed one, and the next query takes another.
        Inside a transaction the rollback that must follow makes psycopg forget them."""
        conn = self.connection
        if conn is None or conn.closed or conn.prepare_threshold is None:
            return
        if conn.info.transaction_status != pq.TransactionStatus.IDLE:
            return
        logger.info("a pipeline failed; its connection is replaced, as its prepared statements may not be")
        conn.close()
        self.close()

    def _pipeline_run(self, cursors: list[Any], statements: Sequence[tuple[str, Any]]) -> None:
        # Django's cursors, so that each statement is logged and wrapped as any other; they send
        # here, and the pipeline's end (one Sync) collects every result.
        with self.wrap_database_errors, self.connection.pipeline():
            for cursor, (sql, params) in zip(cursors, statements, strict=True):
                cursor.execute(sql, params)

    def get_connection_params(self) -> dict[str, Any]:
        params = super().get_connection_params()
        if params.get("cursor_factory") is ServerBindingCursor:
            params["cursor_factory"] = PreparedCursor
        return params
