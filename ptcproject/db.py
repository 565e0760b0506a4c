"""Working through a database that may drop away for a while (a restart)."""

import functools
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, DatabaseError, InterfaceError, OperationalError, connection, connections, transaction

logger = logging.getLogger("ptc.db")
T = TypeVar("T")


def db_reset() -> None:
    """Drop this thread's database connection, broken or not: the next query takes a fresh one."""
    try:
        connection.close()
    except DatabaseError:
        pass


def statement_cancelled(exc: BaseException) -> bool:
    """Whether a database error (Django's) is PostgreSQL cancelling a statement (PTC_DB_STATEMENT_TIMEOUT,
    a lock timeout, an operator), not the database being out of reach."""
    from psycopg.errors import LockNotAvailable, QueryCanceled

    return isinstance(exc.__cause__, QueryCanceled | LockNotAvailable)


def deadlocked(exc: BaseException) -> bool:
    """Whether a database error (Django's) is PostgreSQL cancelling the transaction as one side of a
    deadlock (two transactions each waiting on a row the other holds): the transaction is rolled
    back, and the same work tried again is likely to go through."""
    from psycopg.errors import DeadlockDetected

    return isinstance(exc.__cause__, DeadlockDetected)


def database_read_only(exc: BaseException) -> bool:
    """Whether a database error (Django's) is PostgreSQL refusing a write because its server is
    read-only: a standby, as the old primary is after a failover (ptcproject.postgres.base's
    FailoverErrorWrapper raises it as an OperationalError)."""
    from psycopg.errors import ReadOnlySqlTransaction

    return isinstance(exc.__cause__, ReadOnlySqlTransaction)


def db_unreachable_reason() -> str | None:
    """Return, in one line, why this process can't open a connection to its PostgreSQL database
    (the server's own words, which the pool's "couldn't get a connection" hides), or None when it can,
    or when the database is not PostgreSQL."""
    db = settings.DATABASES["default"]
    if db["ENGINE"] != "ptcproject.postgres":
        return None
    import psycopg

    try:
        pg_connect().close()
    except psycopg.Error as error:
        said = " ".join(str(error).split())
        return f"cannot reach the database at {db.get('HOST') or 'localhost'}:{db.get('PORT') or 5432} (DATABASE_URL): {said}"
    return None


def pg_connect(alias: str = DEFAULT_DB_ALIAS, **options: Any) -> Any:
    """Open a psycopg connection of its own (outside Django's pool) to the database ``alias``, which
    must be PostgreSQL, with ``options`` (``autocommit=True``...). Return it, connected as the
    pool's are: with DATABASE_URL's own options (``?sslmode=verify-full``, ``?options=...``) and the
    connect timeout, where libpq's defaults (``sslmode=prefer``: no certificate checked) would not."""
    import psycopg

    params = connections[alias].get_connection_params()
    for django_only in ("cursor_factory", "context", "prepare_threshold"):  # Django's cursors and adapters
        params.pop(django_only, None)
    return psycopg.connect(**{**params, **options})


def db_retry(work: Callable[[], T], *, what: str, job_id: Any, on_wait: Callable[[], None] | None = None, call_id: str = "") -> T:
    """Run ``work``; while the database is unreachable (or cancels its statement), retry it on a fresh
    connection with backoff, for up to PTC_DB_RETRY_SECONDS. Raise the last error after that.
    ``on_wait`` is called once, before the first wait: what must not wait as long as the database
    does. ``job_id`` and ``call_id`` (either may be empty) name what the log lines are about."""
    ids = {name: str(value) for name, value in (("job_id", job_id), ("call_id", call_id)) if value}
    deadline = time.monotonic() + settings.PTC_DB_RETRY_SECONDS
    delay = 0.2
    while True:
        try:
            return work()
        except (OperationalError, InterfaceError) as exc:
            if time.monotonic() + delay > deadline:
                raise
            if on_wait is not None:
                on_wait()
                on_wait = None
            if statement_cancelled(exc):
                why = "a statement was cancelled (statement or lock timeout)"
            else:
                why = "the database is read-only (a failover?)" if database_read_only(exc) else "database unreachable"
            logger.warning("%s while %s; retrying in %.1f s", why, what, delay, extra=ids)
            db_reset()
            time.sleep(delay)
            # At most a second apart: once the database is back, the work is done within a second,
            # before any reaper stops trusting the leases that lapsed meanwhile.
            delay = min(delay * 2, 1.0)


def unless_cancelled(work: Callable[[], T], *, what: str, **ids: Any) -> T | None:
    """Run ``work`` and return what it returns; or None, logged, if PostgreSQL cancelled its
    statement: a row it needs held locked past PTC_DB_STATEMENT_TIMEOUT by a transaction stuck
    elsewhere. For work that may wait, or be left undone: one item of a round of upkeep (the
    reaper's), left to a later round while the round goes on with the others, which one stuck row
    must not hold up; or bookkeeping after what a request did, which must not turn its answer into
    a 503. Any other error is raised (an outage). ``ids`` (``job_id=``, ``call_id=``...) go on the
    log line."""
    try:
        return work()
    except OperationalError as exc:
        if not statement_cancelled(exc):
            raise
        logger.warning("%s skipped this round: a row it needs is held locked (its statement was cancelled)", what, extra=ids)
        return None


# How long a statement that must not hold up others waits on a row lock before PostgreSQL cancels it
# (its lock_timeout, PTC_DB_STATEMENT_TIMEOUT otherwise): a lock held longer is a transaction stuck
# elsewhere, or one the statement can go round (a tools worker's batch: its calls then go alone; a
# reaper's round: the row waits for the next). Longer than a row is held by any statement's
# transaction of ours on a busy machine; a wait cut short costs a statement again, never a result.
BRIEF_LOCK_WAIT_MS = 200


def brief_lock_wait_sql(placeholder: str = "%(lock_wait)s") -> str:
    """A condition for a PostgreSQL statement's WHERE that holds and sets the lock_timeout of its
    transaction to its parameter's value (``placeholder``'s: ``brief_lock_wait``, ``'200ms'``), or
    leaves it as it is when that value is NULL. An uncorrelated subquery: PostgreSQL evaluates it once,
    before the statement's scan (a one-time filter), so every lock it then waits on (a row it
    updates, a foreign key's check at the commit) is waited on that long at most. One round trip,
    where ``SET LOCAL`` in a transaction of its own took three more."""
    return f"(SELECT set_config('lock_timeout', COALESCE({placeholder}, current_setting('lock_timeout')), true)) IS NOT NULL"


def brief_lock_wait(brief: bool) -> str | None:
    """The value of ``brief_lock_wait_sql``'s parameter: ``BRIEF_LOCK_WAIT_MS`` with ``brief``, else None."""
    return f"{BRIEF_LOCK_WAIT_MS}ms" if brief else None


def unless_locked(work: Callable[[], T], *, what: str, **ids: Any) -> T | None:
    """``unless_cancelled`` for one item of a round of upkeep (the reaper's), whose statements wait
    on a lock ``BRIEF_LOCK_WAIT_MS`` at most (on PostgreSQL): a row held locked by a transaction stuck
    elsewhere costs the round that, not PTC_DB_STATEMENT_TIMEOUT, and is left to a later round.
    Each statement outside a transaction goes in one of its own (a round trip or three more)."""
    with lock_wait_brief():
        return unless_cancelled(work, what=what, **ids)


class LockedRows:
    """The rows of ``model`` (by ``field``) a reaper found held locked (its statement cancelled), for
    rows whose lease their worker renews: the worker's renewals wait on the same lock, and are
    cancelled as the reaper's statement is, so a live worker's lease lapses. Such a row is judged
    a whole lease (PTC_JOB_LEASE_SECONDS) after it was last found held: each round probes it again
    (``SELECT ... FOR UPDATE SKIP LOCKED``, which waits on nothing), so the lease is counted from
    when the lock went, as every lease is after an outage. One process's reaper, one thread."""

    def __init__(self, model: Any, field: str) -> None:
        self.model, self.field = model, field
        self.found: dict[Any, float] = {}  # when each was last found held (time.monotonic())

    def held(self, key: Any) -> None:
        """Say the row of ``key`` was just found held locked."""
        self.found[key] = time.monotonic()

    def waits(self, key: Any) -> bool:
        """Whether the row of ``key`` (lapsed) is left to a later round: held locked now, or within a
        lease of when it last was."""
        found = self.found.get(key)
        if found is None:
            return False
        with transaction.atomic():
            free = self.model.objects.select_for_update(skip_locked=True).filter(**{self.field: key}).values_list("pk").first()
        if free is None:
            self.held(key)
            return True
        if time.monotonic() - found < settings.PTC_JOB_LEASE_SECONDS:
            return True
        del self.found[key]
        return False

    def keep_only(self, keys: set[Any]) -> None:
        """Forget the rows not among ``keys`` (those still lapsed): renewed, or ended."""
        for key in [key for key in self.found if key not in keys]:
            del self.found[key]


@contextmanager
def statement_timeout_off(alias: str = DEFAULT_DB_ALIAS) -> Iterator[None]:
    """Run the block's statements on this thread's connection to ``alias`` with no
    PTC_DB_STATEMENT_TIMEOUT (its statement_timeout and lock_timeout, or those set on the role): for
    work whose statements may rightly run long on a large database (a retention round's purge, the
    ledger's check), not for a request's or a call's.

    Each statement runs in a transaction that lifts both until it ends (``SET LOCAL``): the block's
    own ``atomic`` block, or one of its own around a statement outside them. Nothing outlives the
    transaction. A session's ``SET`` would: behind PgBouncer in transaction mode it stayed on the
    server connection the pooler lent, for whichever client came next, and the block's next
    statement went to another server connection, with the timeout. It costs a round trip per statement."""
    with _each_transaction_set("SELECT set_config('statement_timeout', '0', true), set_config('lock_timeout', '0', true)", alias):
        yield


@contextmanager
def lock_wait_brief(alias: str = DEFAULT_DB_ALIAS) -> Iterator[None]:
    """Run the block's statements on this thread's connection to ``alias`` with a lock_timeout of
    ``BRIEF_LOCK_WAIT_MS``, each transaction's own (as ``statement_timeout_off``)."""
    with _each_transaction_set(f"SELECT set_config('lock_timeout', '{BRIEF_LOCK_WAIT_MS}ms', true)", alias):
        yield


@contextmanager
def _each_transaction_set(setting: str, alias: str) -> Iterator[None]:
    """Run ``setting`` (a ``set_config(..., true)``) first in the transaction of each of the block's
    statements on ``alias``: the block's own ``atomic`` block, a pipeline's (``rows.together``), or
    one of its own around a statement outside them. Nothing outside PostgreSQL."""
    database = connections[alias]
    if database.vendor != "postgresql":
        yield
        return
    with database.execute_wrapper(functools.partial(_set_in_transaction, setting)):
        yield


def _set_in_transaction(
    setting: str, execute: Callable[..., Any], sql: str, params: Any, many: bool, context: dict[str, Any]
) -> Any:
    from psycopg import pq

    database = context["connection"]
    # In a transaction already: the block's ``atomic``, or the one a pipeline's statements make
    # (``rows.together``: sent at once, all or nothing). A transaction of its own for each of those
    # committed the first ones though a later one failed, and took a round trip or three each.
    if not database.get_autocommit() or database.connection.pgconn.pipeline_status != pq.PipelineStatus.OFF:
        _set_first(database, context["cursor"], setting)
        return execute(sql, params, many, context)
    with transaction.atomic(using=database.alias):
        _set_first(database, context["cursor"], setting)
        return execute(sql, params, many, context)


def _set_first(database: Any, cursor: Any, setting: str) -> None:
    # On psycopg's cursor (not through the wrappers again), but through Django's translation of its
    # errors, as every statement: the SET is the transaction's first statement, the one that finds
    # a connection lost (a restart, a killed backend), which must be Django's OperationalError, an
    # outage's, not psycopg's own error, which no outage path knows.
    with database.wrap_database_errors:
        cursor.cursor.execute(setting)
