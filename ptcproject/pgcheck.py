"""The connection pool's check: a connection used a moment ago is handed out without a round trip.

psycopg_pool's own check (what Django's ``CONN_HEALTH_CHECKS`` sets) sends an empty query every
time a connection leaves the pool. Workers give theirs back around every task and every tool
call, so that was a round trip to PostgreSQL on every checkout: a good part of a tool call's cost.
A connection handed out less than ``CHECK_AFTER`` seconds ago, and given back unbroken (psycopg
marks one that failed broken, and the pool drops it), is trusted; an older one is checked. If
PostgreSQL restarts inside that window, the one query that finds out fails with OperationalError,
which every caller already retries or answers 503 for, and the pool replaces the connection.

Only psycopg here: settings import this module, before Django's database layer is set up.
"""

import time
import weakref
from typing import Any

from psycopg_pool import ConnectionPool

CHECK_AFTER = 1.0
_last_out: "weakref.WeakKeyDictionary[Any, float]" = weakref.WeakKeyDictionary()


def check_unless_recent(conn: Any) -> None:
    """Raise if ``conn`` is broken; send the empty query only if it sat in the pool a while."""
    now = time.monotonic()
    last = _last_out.get(conn)
    _last_out[conn] = now
    if conn.broken or conn.closed:
        raise ConnectionError("the connection is closed")
    if last is None or now - last > CHECK_AFTER:
        ConnectionPool.check_connection(conn)
