"""Migration operations that keep a live database writable while they run."""

from typing import Any

from django.contrib.postgres.operations import AddIndexConcurrently as PostgresAddIndexConcurrently
from django.db import migrations


def _invalid_index_drop(schema_editor: Any, name: str) -> None:
    """Drop the index ``name`` if a concurrent build that failed or was cut off left it invalid
    (and its migration unrecorded), so that the build can be tried again."""
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(
            "SELECT 1 FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid"
            " WHERE c.relname = %s AND pg_table_is_visible(c.oid) AND NOT i.indisvalid",
            [name],
        )
        if cursor.fetchone():
            cursor.execute(f'DROP INDEX CONCURRENTLY "{name}"')


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
        _invalid_index_drop(schema_editor, self.index.name)
        concurrently = PostgresAddIndexConcurrently(self.model_name, self.index)
        concurrently.database_forwards(app_label, schema_editor, from_state, to_state)

    def database_backwards(self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any) -> None:
        if schema_editor.connection.vendor != "postgresql":
            super().database_backwards(app_label, schema_editor, from_state, to_state)
            return
        concurrently = PostgresAddIndexConcurrently(self.model_name, self.index)
        concurrently.database_backwards(app_label, schema_editor, from_state, to_state)


class AddConstraintConcurrently(migrations.AddConstraint):
    """Django's ``AddConstraint`` for a constraint PostgreSQL keeps as a unique index (a
    ``UniqueConstraint`` with a condition, expressions or included columns), built concurrently as
    ``AddIndexConcurrently`` builds an index, with the same care for a build cut off; plainly elsewhere."""

    atomic = False

    def database_forwards(self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any) -> None:
        model = to_state.apps.get_model(app_label, self.model_name)
        if schema_editor.connection.vendor != "postgresql" or not self.allow_migrate_model(schema_editor.connection.alias, model):
            super().database_forwards(app_label, schema_editor, from_state, to_state)
            return
        statement: Any = self.constraint.create_sql(model, schema_editor)  # a Statement; the stubs say str
        plain = "CREATE UNIQUE INDEX "
        if not statement.template.startswith(plain):
            raise ValueError(f"{self.constraint.name} is not kept as a unique index: it can't be added concurrently")
        statement.template = statement.template.replace(plain, "CREATE UNIQUE INDEX CONCURRENTLY ", 1)
        _invalid_index_drop(schema_editor, self.constraint.name)
        schema_editor.execute(statement, params=None)
