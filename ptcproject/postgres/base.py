"""Django's PostgreSQL backend, with the pool checking connections as ``ptcproject.pgcheck`` says,
and statements prepared where a migration may change what they return.

Django builds the psycopg pool itself and always passes it its own ``check`` (a round trip on every
checkout with CONN_HEALTH_CHECKS, none at all without); this backend swaps in ours.
"""

import logging
from typing import Any

import psycopg
from django.db.backends.postgresql.base import DatabaseWrapper as PostgresWrapper
from django.db.backends.postgresql.base import ServerBindingCursor
from psycopg import errors, pq

from ptcproject.pgcheck import check_unless_recent

logger = logging.getLogger("ptc.db")


def _stale_plan(exc: errors.FeatureNotSupported) -> bool:
    """Whether PostgreSQL refused a prepared statement whose columns changed type under it (a
    migration altered a column): it fails on that connection until it is deallocated. By the
    code and the server function that raise it, not the message, which the server may translate."""
    return exc.sqlstate == "0A000" and exc.diag.source_function == "RevalidateCachedQuery"


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


class DatabaseWrapper(PostgresWrapper):
    @property
    def pool(self) -> Any:
        pool = super().pool
        if pool is not None and pool._check is not check_unless_recent:
            pool._check = check_unless_recent  # where psycopg_pool keeps it; tests/test_db.py checks it is used
        return pool

    def get_connection_params(self) -> dict[str, Any]:
        params = super().get_connection_params()
        if params.get("cursor_factory") is ServerBindingCursor:
            params["cursor_factory"] = PreparedCursor
        return params
