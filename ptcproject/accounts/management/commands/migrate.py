"""Django's ``migrate``, one at a time per PostgreSQL database.

Every web replica runs it before it starts (deploy/kubernetes/web.yaml's init container, compose's
``migrate`` service): two at once on a new database both created its first tables, and one failed
(``duplicate key value violates unique constraint "pg_type_typname_nsp_index"``), its pod restarted.
Here each takes a PostgreSQL advisory lock in turn, held on a connection of its own for the whole
run, and the second then finds every migration applied. The lock is a transaction's, that transaction
open for the whole run: behind a PgBouncer in transaction mode (README, PTC_DB_PREPARE_AFTER) a
session's lock stayed on the server connection the pooler gave the next client, and an open
transaction keeps that connection this command's until it ends.
"""

import time
from contextlib import suppress
from typing import Any

from django.core.management.commands.migrate import Command as MigrateCommand
from django.db import DatabaseError, connections
from psycopg import sql

from ptcproject.db import pg_connect
from ptcproject.postgres.base import statement_timeout_set

# The advisory lock's key: any 64-bit number, the same in every process ("ptcmigr" in ASCII).
MIGRATE_LOCK = 0x7074636D696772
LOCK_POLL_SECONDS = 0.2


class Command(MigrateCommand):
    def handle(self, *args: Any, **options: Any) -> None:
        alias = options["database"]
        if connections[alias].vendor != "postgresql":
            super().handle(*args, **options)
            return
        # Django's error, as its own connection's would be: manage.py makes an unreachable database one line.
        with connections[alias].wrap_database_errors:
            lock = pg_connect(alias)
        with lock:
            # Taken by trying, between waits that hold no transaction: a statement waiting on the lock
            # would hold a snapshot, and a concurrent index build (AddIndexConcurrently) in the
            # migrating process waits for every snapshot older than it: the two waited on each other,
            # for ever. The key is written into the statement, not bound as a parameter: a statement
            # with parameters goes by the extended protocol, whose portal keeps its snapshot until the
            # next statement, which here is the end of the run.
            take = sql.SQL("SELECT pg_try_advisory_xact_lock({})").format(sql.Literal(MIGRATE_LOCK))
            while not lock.execute(take).fetchone()[0]:
                lock.rollback()
                time.sleep(LOCK_POLL_SECONDS)
            # A migration may take longer than PTC_DB_STATEMENT_TIMEOUT (an index built on a large
            # table): it runs without it, its statement and lock timeouts both (the lock's connection,
            # not Django's, never had them). Lifted for the session, not per transaction as
            # ptcproject.db.statement_timeout_off lifts it: a concurrent build can't run in a
            # transaction. Behind a pooler in transaction mode the session's setting would go astray
            # (README, "Behind PgBouncer"): migrate runs on a direct connection.
            with connections[alias].cursor() as cursor:
                cursor.execute("SELECT set_config('statement_timeout', '0', false), set_config('lock_timeout', '0', false)")
            try:
                super().handle(*args, **options)
            finally:
                with suppress(DatabaseError), connections[alias].cursor() as cursor:  # the run's own error is the one raised
                    statement_timeout_set(cursor)
        # The lock went with its transaction, which the connection's end ended.
