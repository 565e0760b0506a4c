"""Migration operations that keep a live database writable while they run."""

from typing import Any

from django.contrib.postgres.operations import AddIndexConcurrently as PostgresAddIndexConcurrently
from django.db import migrations


class AddIndexConcurrently(migrations.AddIndex):
    """Django's ``AddIndex``, built with ``CREATE INDEX CONCURRENTLY`` on PostgreSQL, so that writes
    to the table go on while it builds (a plain build holds them for as long as it takes: seconds on
    a large table); built plainly elsewhere (the embedded SQLite). Its migration sets ``atomic =
    False``. A concurrent build that failed or was cut off leaves its index behind, invalid, and the
    migration unrecorded: that index is dropped before the build is tried again."""

    atomic = False

    def database_forwards(self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any) -> None:
        if schema_editor.connection.vendor != "postgresql":
            super().database_forwards(app_label, schema_editor, from_state, to_state)
            return
        with schema_editor.connection.cursor() as cursor:
            cursor.execute(
                "SELECT 1 FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid"
                " WHERE c.relname = %s AND pg_table_is_visible(c.oid) AND NOT i.indisvalid",
                [self.index.name],
            )
            if cursor.fetchone():
                cursor.execute(f'DROP INDEX CONCURRENTLY "{self.index.name}"')
        concurrently = PostgresAddIndexConcurrently(self.model_name, self.index)
        concurrently.database_forwards(app_label, schema_editor, from_state, to_state)

    def database_backwards(self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any) -> None:
        if schema_editor.connection.vendor != "postgresql":
            super().database_backwards(app_label, schema_editor, from_state, to_state)
            return
        concurrently = PostgresAddIndexConcurrently(self.model_name, self.index)
        concurrently.database_backwards(app_label, schema_editor, from_state, to_state)
