from typing import Any

from django.core.management.base import BaseCommand, CommandError
from django.db import connection, transaction

from ptcproject.crypto import SETTING, SecretsUndecryptable, secrets_rotate
from tools.models import Toolset


class Command(BaseCommand):
    help = (
        f"Re-encrypt every toolset's secrets with the first key in {SETTING}. Run it after putting a new key "
        "first; once it has run, the old keys can be dropped."
    )

    def handle(self, *args: Any, **options: Any) -> None:
        # Tokens are read and written as stored, past the field: MultiFernet.rotate opens each with
        # whichever key fits and seals it with the first, keeping the token's timestamp.
        quote = connection.ops.quote_name
        table = quote(Toolset._meta.db_table)
        field = Toolset._meta.get_field("secrets")
        assert field.column is not None, "a concrete field always has a column"
        column = quote(field.column)
        rewritten = 0
        # All or nothing: a row no key opens stops the run with every row as it was.
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(f"SELECT id, {quote('key')}, {column} FROM {table}")  # noqa: S608 (names only, no input)
            for pk, key, token in cursor.fetchall():
                try:
                    rotated = secrets_rotate(token)
                except SecretsUndecryptable as exc:
                    raise CommandError(f"Toolset {key!r} ({pk}): {exc} Nothing was rewritten.") from None
                # Only if unchanged since read: a save in between already wrote a token under the first key.
                cursor.execute(
                    f"UPDATE {table} SET {column} = %s WHERE id = %s AND {column} = %s",  # noqa: S608
                    [rotated, pk, token],
                )
                rewritten += cursor.rowcount
        self.stdout.write(f"Re-encrypted the secrets of {rewritten} toolset(s) with the first key in {SETTING}.")
