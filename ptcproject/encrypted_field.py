"""A model field holding a JSON value encrypted at rest (ptcproject/crypto.py has the keys).

The column is text: a Fernet token of the JSON. Python sees the value itself (a dict for toolset
secrets), so code that reads or assigns the attribute never knows. A database dump, ``dumpdata``
included, shows only tokens. The token changes on every save, so the field can't be filtered on.
"""

import json
from typing import TYPE_CHECKING, Any

from django.db import models
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models.expressions import Expression

from ptcproject.crypto import secrets_decrypt, secrets_encrypt


class EncryptedJSONField(models.TextField):
    description = "A JSON value, encrypted at rest with PTC_SECRETS_KEYS"

    if TYPE_CHECKING:
        # For the django-stubs plugin: the model attribute holds the decoded JSON value (any JSON,
        # as django-stubs types JSONField), not the str that TextField's column would give.
        _pyi_private_set_type: Any
        _pyi_private_get_type: Any

    def from_db_value(self, value: str | None, expression: Expression, connection: BaseDatabaseWrapper) -> Any:
        """Return the decrypted value. Raise SecretsUndecryptable when no configured key opens it,
        rather than hand back garbage or an empty value that a later save would write over them."""
        if value is None:
            return None
        return json.loads(secrets_decrypt(value))

    def to_python(self, value: Any) -> Any:
        """Return the value itself; a token (as ``loaddata`` reads from ``dumpdata``) is decrypted."""
        if isinstance(value, str):
            return json.loads(secrets_decrypt(value))
        return value

    def get_prep_value(self, value: Any) -> str | None:
        """Return the token stored for ``value``: every write, ``update()`` and ``bulk_update`` included, encrypts."""
        if value is None:
            return None
        return secrets_encrypt(json.dumps(value))

    def value_to_string(self, obj: models.Model) -> str:
        """Return the token, so serialised dumps hold no secret either."""
        return self.get_prep_value(self.value_from_object(obj)) or ""
