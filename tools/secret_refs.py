"""``{{secrets.NAME}}`` references in a toolset's config, and keeping secret values out of text.

A toolset's secrets are write-only (PRODUCT.md). Config values name them; only the tools worker
(and the web process, for an MCP sync) fills them in, right before a request, and every message
built from a response goes through ``secrets_redact`` before it is stored, logged or shown.
"""

import functools
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any
from urllib.parse import quote, quote_plus

# What a secret may be named: what a reference can name.
REF_NAME = r"[A-Za-z_][A-Za-z0-9_]*"
SECRET_REF = re.compile(r"\{\{\s*secrets\.(" + REF_NAME + r")\s*\}\}")
REDACTED = "[redacted]"
# Shorter values would redact ordinary words and digits out of every message.
_MIN_REDACT_LENGTH = 4


def secret_names_problem(names: Iterable[str]) -> str | None:
    """What is wrong with the first of ``names`` that no ``{{secrets.NAME}}`` could name, or None."""
    for name in names:
        if not re.fullmatch(REF_NAME, name):
            return f"{name!r} is not a secret's name: letters, digits and _, not first a digit ({{{{secrets.NAME}}}} names it)"
    return None


class MissingSecret(KeyError):
    """A config value names a secret the toolset does not have."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


def secret_names_used(value: Any) -> set[str]:
    """Return the secret names referenced anywhere in ``value`` (strings, lists, dict values)."""
    if isinstance(value, str):
        return set(SECRET_REF.findall(value))
    if isinstance(value, Mapping):
        return set().union(*(secret_names_used(v) for v in value.values())) if value else set()
    if isinstance(value, list | tuple):
        return set().union(*(secret_names_used(v) for v in value)) if value else set()
    return set()


def headers_problem(headers: Any, secrets: Mapping[str, Any]) -> str | None:
    """Why ``headers`` (header → a value that may use ``{{secrets.NAME}}``) can't be sent with
    ``secrets`` filled in: HTTP headers are ASCII. The secrets are named, never quoted."""
    for name, template in (headers or {}).items():
        culprits = sorted(n for n in secret_names_used(template) if not str(secrets.get(n) or "").isascii())
        if culprits or not (str(name).isascii() and str(template).isascii()):
            with_ = f" (with the secret {', '.join(repr(n) for n in culprits)})" if culprits else ""
            return f"{name!r}{with_} has a character that is not ASCII, which HTTP headers are"
    return None


def headers_ascii(headers: Mapping[str, str]) -> bool:
    """Whether rendered ``headers`` can be sent as they are: the cheap check of every call, which
    ``headers_problem`` (on the templates, naming the secret) words when it fails."""
    return all(name.isascii() and value.isascii() for name, value in headers.items())


def secrets_render(value: str, secrets: Mapping[str, str]) -> str:
    """Return ``value`` with each ``{{secrets.NAME}}`` replaced by its value. Raise MissingSecret."""

    def fill(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in secrets:
            raise MissingSecret(name)
        return str(secrets[name])

    return SECRET_REF.sub(fill, value)


def secrets_render_map(values: Mapping[str, Any] | None, secrets: Mapping[str, str]) -> dict[str, str]:
    """Return a str → str map (headers, env) with its secret references filled in."""
    return {str(k): secrets_render(str(v), secrets) for k, v in (values or {}).items()}


def _forms(secrets: Iterable[str]) -> tuple[str, ...]:
    """The texts to redact for ``secrets``: each value as it is and as a message may quote it
    escaped (a value pasted with its newline shows in httpx's error as ``\\n``; JSON escapes it
    too, and some encoders, PHP's, escape its "/" as ``\\/``; a URL, a redirect's Location, has
    it percent-encoded), longest first, so a secret that contains another is redacted whole."""
    return _forms_of(frozenset(str(s) for s in secrets if s and len(str(s)) >= _MIN_REDACT_LENGTH))


@functools.lru_cache(maxsize=256)
def _forms_of(secrets: frozenset[str]) -> tuple[str, ...]:
    """``_forms``, made once per set of secrets: a chatty stdio server's stderr is cut with them at
    each chunk, and a synced tool list redacted field by field."""
    forms = set()
    for secret in secrets:
        escaped = json.dumps(secret)[1:-1]
        forms |= {secret, secret.encode("unicode_escape").decode("ascii"), escaped, escaped.replace("/", "\\/")}
        # A base64 key's "+", "/" and "=", as a URL's path (quote) or its query (quote_plus) has them.
        forms |= {quote(secret), quote(secret, safe=""), quote_plus(secret, safe="")}
    return tuple(sorted(forms, key=len, reverse=True))


def _redacted(text: str, forms: Sequence[str]) -> str:
    for form in forms:
        text = text.replace(form, REDACTED)
    return text


def secrets_redact(text: str, secrets: Iterable[str]) -> str:
    """Return ``text`` with every secret value replaced by ``[redacted]`` (``_forms``)."""
    return _redacted(text, _forms(secrets))


def secrets_tail(text: str, size: int, secrets: Iterable[str]) -> str:
    """Return the end of ``text`` to keep of a stream: its last ``size`` characters, or more, never
    the end of a secret without its start (which ``secrets_redact`` could not find).

    A secret the cut would fall in is kept whole; so is one whose end is still to come (``size`` is
    raised to the longest secret's), because the next cut keeps it whole once it is.
    """
    forms = _forms(secrets)
    start = len(text) - max([size, *map(len, forms)])
    if start <= 0:
        return text
    moved = True
    while moved:  # keeping a secret whole may put the cut inside another
        moved = False
        for form in forms:
            found = text.find(form, max(0, start - len(form) + 1))
            if -1 < found < start:
                start, moved = found, True
    return text[start:]


def secrets_reach(secrets: Iterable[str]) -> int:
    """Return how many bytes past what a message shows a text's start must be read, so that a secret
    starting in what it shows is read whole: the longest text ``secrets_redact`` replaces, in UTF-8."""
    return max((len(form.encode()) for form in _forms(secrets)), default=0)


def secrets_redact_start(text: str, secrets: Iterable[str]) -> str:
    """Return ``secrets_redact(text)`` for the start of a longer text, less as many characters at its
    end as the longest secret: a secret cut off there no longer matches, and its start would show.
    Read the start ``secrets_reach`` bytes longer, so what is left is still what is shown."""
    forms = _forms(secrets)
    if not forms:
        return text
    redacted = _redacted(text, forms)
    return redacted[: max(0, len(redacted) - len(forms[0]))]


def secrets_redact_value(value: Any, secrets: Iterable[str]) -> Any:
    """Return a JSON value with ``secrets_redact`` applied to every string and key in it, and to every
    number as JSON writes it (a number with a secret in it becomes a string).

    A server that echoes a header or its environment back must not carry a secret into the sandbox.
    """
    forms = _forms(secrets)
    return _redacted_value(value, forms) if forms else value


def _redacted_value(value: Any, forms: Sequence[str]) -> Any:
    if isinstance(value, str):
        return _redacted(value, forms)
    if isinstance(value, int | float) and not isinstance(value, bool):
        # A secret of digits (an account number, a PIN) echoed back as a number: redacted as JSON
        # writes it, and then a string; other numbers stay numbers.
        written = json.dumps(value)
        redacted = _redacted(written, forms)
        return value if redacted == written else redacted
    if isinstance(value, list):
        return [_redacted_value(v, forms) for v in value]
    if isinstance(value, dict):
        return {_redacted(str(k), forms): _redacted_value(v, forms) for k, v in value.items()}
    return value
