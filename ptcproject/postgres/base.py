"""Django's PostgreSQL backend, with the pool checking connections as ``ptcproject.pgcheck`` says.

Django builds the psycopg pool itself and always passes it its own ``check`` (a round trip on every
checkout with CONN_HEALTH_CHECKS, none at all without); this backend swaps in ours.
"""

from typing import Any

from django.db.backends.postgresql.base import DatabaseWrapper as PostgresWrapper

from ptcproject.pgcheck import check_unless_recent


class DatabaseWrapper(PostgresWrapper):
    @property
    def pool(self) -> Any:
        pool = super().pool
        if pool is not None and pool._check is not check_unless_recent:
            pool._check = check_unless_recent  # where psycopg_pool keeps it; tests/test_db.py checks it is used
        return pool
