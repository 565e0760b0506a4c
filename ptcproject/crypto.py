"""Encryption at rest for toolset secrets: Fernet tokens under the keys of ``PTC_SECRETS_KEYS``.

The first key encrypts; every key decrypts, so a key is rotated by putting a new one first, running
``python manage.py ptc_rotate_secrets``, then dropping the old one. Settings parse the keys at
start-up (``secrets_keys``), so a bad key stops every process at once, naming the variable. This
module imports no models: settings import it.
"""

import base64
import functools

from cryptography.fernet import Fernet, InvalidToken, MultiFernet
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

SETTING = "PTC_SECRETS_KEYS"
# Names this use of DJANGO_SECRET_KEY, so the derived key is no other key Django derives from it.
_HKDF_INFO = b"ptc toolset secrets at rest"


class SecretsUndecryptable(ImproperlyConfigured):
    """Stored secrets that no key in PTC_SECRETS_KEYS can decrypt: a key they need was dropped."""

    def __init__(self) -> None:
        super().__init__(
            f"Toolset secrets in the database were encrypted with a key that is not in {SETTING} "
            f"(when {SETTING} is unset, the one key is derived from DJANGO_SECRET_KEY). Add the key they "
            f"were written with to {SETTING}, after the current first key, and restart."
        )


def secrets_keys(raw: str, *, secret_key: str) -> list[str]:
    """Return the Fernet keys in ``raw`` (comma-separated; the first encrypts), each checked.

    An empty ``raw`` gives one key derived from ``secret_key``: the embedded quickstart then needs
    no extra setting, and its secrets still never sit in plain text in the database. Raise
    ImproperlyConfigured naming PTC_SECRETS_KEYS for a value that is not a list of Fernet keys.
    """
    if not raw.strip():
        derived = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_HKDF_INFO).derive(secret_key.encode())
        return [base64.urlsafe_b64encode(derived).decode()]
    keys = [item.strip() for item in raw.split(",") if item.strip()]
    if not keys:
        raise ImproperlyConfigured(f"{SETTING} lists no key; unset it or give comma-separated Fernet keys.")
    for number, key in enumerate(keys, start=1):
        try:
            Fernet(key)
        except ValueError:
            # The value itself is a secret: say which one is wrong, never what it is.
            raise ImproperlyConfigured(
                f"{SETTING}: key {number} of {len(keys)} is not a Fernet key (32 url-safe base64-encoded bytes). "
                'Make one with: python -c "from cryptography.fernet import Fernet; print(Fernet.generate_key().decode())"'
            ) from None
    return keys


@functools.lru_cache(maxsize=4)
def _multi_fernet(keys: tuple[str, ...]) -> MultiFernet:
    return MultiFernet([Fernet(key) for key in keys])


def secrets_fernet() -> MultiFernet:
    """Return the MultiFernet for the keys settings hold now (cached per list of keys, so a changed
    setting, as in a test's override, takes effect at once)."""
    return _multi_fernet(tuple(settings.PTC_SECRETS_KEYS))


def secrets_encrypt(plaintext: str) -> str:
    """Return the Fernet token of ``plaintext`` under the first key."""
    return secrets_fernet().encrypt(plaintext.encode()).decode()


def secrets_decrypt(token: str) -> str:
    """Return the plaintext of ``token``. Raise SecretsUndecryptable when no key opens it."""
    try:
        return secrets_fernet().decrypt(token.encode()).decode()
    except InvalidToken:
        raise SecretsUndecryptable() from None


def secrets_rotate(token: str) -> str:
    """Return ``token`` re-encrypted under the first key. Raise SecretsUndecryptable when no key opens it."""
    try:
        return secrets_fernet().rotate(token.encode()).decode()
    except InvalidToken:
        raise SecretsUndecryptable() from None
