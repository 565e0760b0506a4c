"""Making values fit the database: PostgreSQL text and jsonb hold neither NUL nor lone surrogates."""

from typing import Any


def _text(value: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates, e.g. from a str built out of raw escapes
        value = value.encode("utf-8", "replace").decode("utf-8")
    return value.replace("\x00", "\ufffd") if "\x00" in value else value


def storable(value: Any) -> Any:
    """Return ``value`` with every string (keys included) safe to store; NUL becomes U+FFFD."""
    if isinstance(value, str):
        return _text(value)
    if isinstance(value, dict):
        return {_text(str(k)): storable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [storable(v) for v in value]
    return value
