"""Typed, checked readers of the environment: every variable settings read goes through one of these.

Each reader takes the variable's name, its default and what it may be (a range, a choice, a URL's
schemes), and a value it can't take is an ImproperlyConfigured naming the variable, what it takes
and what it got. ``parse_*`` raise at once (the policy's seed uses them); ``Env`` collects every bad
variable and ``Env.stop`` ends start-up with one line each, no traceback: settings are read by
``manage.py``, Celery and uvicorn alike, and a traceback through any of them buries the one line
an operator needs (STYLE.md §9).

environ's own readers are not used for numbers and booleans: its float keeps only the digits of
what it is given ("1e3" reads 13.0, "2 minutes" 2.0) and its bool reads any unknown word as false.
"""

import math
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlsplit

from django.core.exceptions import ImproperlyConfigured

T = TypeVar("T")
TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")


def _raw(name: str) -> str | None:
    """Return the variable's value with surrounding blanks removed, or None when it is unset or blank."""
    value = os.environ.get(name)
    if value is None or not value.strip():
        return None
    return value.strip()


def parse_int(name: str, default: int, low: int, high: int) -> int:
    """Return ``name`` as a whole number from ``low`` to ``high``, or ``default`` when unset or blank."""
    raw = _raw(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ImproperlyConfigured(f"{name} must be a whole number from {low} to {high}; got {raw!r}.") from None
    if not low <= value <= high:
        raise ImproperlyConfigured(f"{name} must be a whole number from {low} to {high}; got {value}.")
    return value


def parse_float(name: str, default: float, low: float, high: float, *, above_low: bool = False) -> float:
    """Return ``name`` as a finite number of ``low`` (or more than ``low``, with ``above_low``) to
    ``high``, or ``default`` when unset or blank."""
    raw = _raw(name)
    lowest = f"more than {low:g}" if above_low else f"{low:g}"
    takes = f"{name} must be a number of seconds from {lowest} to {high:g}"
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ImproperlyConfigured(f"{takes}; got {raw!r}.") from None
    if not math.isfinite(value) or value < low or (above_low and value == low) or value > high:
        raise ImproperlyConfigured(f"{takes}; got {raw!r}.")
    return value


def parse_bool(name: str, default: bool = False) -> bool:
    """Return ``name`` as true (1, true, yes, on) or false (0, false, no, off), or ``default``."""
    raw = _raw(name)
    if raw is None:
        return default
    if raw.lower() in TRUE:
        return True
    if raw.lower() in FALSE:
        return False
    raise ImproperlyConfigured(f"{name} must be true or false; got {raw!r}.")


def parse_choice(name: str, default: str, choices: Iterable[str]) -> str:
    """Return ``name`` lower-cased when it is one of ``choices``, or ``default`` when unset or blank."""
    raw = _raw(name)
    if raw is None:
        return default
    allowed = list(choices)
    if raw.lower() not in allowed:
        raise ImproperlyConfigured(f"{name} must be one of {', '.join(allowed)}; got {raw!r}.")
    return raw.lower()


def parse_url(name: str, default: str, schemes: Iterable[str]) -> str:
    """Return ``name`` when it is a URL with one of ``schemes``, or ``default`` when unset. Set but
    blank is an error: a URL lost by a template would otherwise run on the default silently."""
    value = os.environ.get(name)
    allowed = list(schemes)
    takes = f"{name} must be a URL starting {' or '.join(f'{s}://' for s in allowed)}"
    if value is None:
        return default
    if not value.strip():
        raise ImproperlyConfigured(f"{takes}; it is set but empty (unset it for the default).")
    value = value.strip()
    if urlsplit(value).scheme.lower() not in allowed or "://" not in value:
        # Never the value itself: a URL may carry a password.
        raise ImproperlyConfigured(f"{takes}; got one starting {value.split('://')[0][:20]!r}.")
    return value


def parse_list(name: str, default: list[str]) -> list[str]:
    """Return ``name``'s comma-separated items, each stripped of blanks, without empty ones or
    repeats, or ``default`` when unset. environ's list kept the blanks: "a.example.com, localhost"
    allowed " localhost", which no Host header is."""
    value = os.environ.get(name)
    if value is None:
        return list(default)
    return list(dict.fromkeys(item.strip() for item in value.split(",") if item.strip()))


def parse_path(name: str, default: str) -> Path:
    """Return ``name`` as an absolute path, or ``default`` when unset. Each process resolves a
    relative one against its own working directory, so two would use two places."""
    value = os.environ.get(name)
    if value is None:
        return Path(default)
    if not value.strip() or not os.path.isabs(value.strip()):
        raise ImproperlyConfigured(f"{name} must be an absolute path; got {value!r}.")
    return Path(value.strip())


def parse_folder(name: str) -> Path | None:
    """Return ``name`` as an existing folder this process can write, or None when unset. Set but
    blank is an error: prometheus_client takes a variable that is there at all for set, and wrote
    its files into each process's working directory."""
    if name not in os.environ:
        return None
    raw = _raw(name)
    if raw is None:
        raise ImproperlyConfigured(f"{name} is set but empty; unset it, or name a folder every process can write.")
    if not os.path.isabs(raw) or not os.path.isdir(raw) or not os.access(raw, os.W_OK | os.X_OK):
        raise ImproperlyConfigured(
            f"{name} must be an absolute path to a folder that exists and this process can write; got {raw!r}."
        )
    return Path(raw)


class Env:
    """The readers above, each collecting its error instead of raising, so that one start-up names
    every bad variable. A reader whose variable is bad returns its default, so reading goes on."""

    def __init__(self) -> None:
        self.errors: list[str] = []

    def guard(self, read: Callable[[], T], fallback: T) -> T:
        """Return ``read()``; on ImproperlyConfigured, note its message and return ``fallback``."""
        try:
            return read()
        except ImproperlyConfigured as error:
            self.errors.append(str(error))
            return fallback

    def require(self, ok: bool, message: str) -> None:
        """Note ``message`` as an error unless ``ok`` (a rule between variables)."""
        if not ok:
            self.errors.append(message)

    def int(self, name: str, default: int, low: int, high: int) -> int:
        return self.guard(lambda: parse_int(name, default, low, high), default)

    def float(self, name: str, default: float, low: float, high: float, *, above_low: bool = False) -> float:
        return self.guard(lambda: parse_float(name, default, low, high, above_low=above_low), default)

    def bool(self, name: str, default: bool = False) -> bool:
        return self.guard(lambda: parse_bool(name, default), default)

    def choice(self, name: str, default: str, choices: Iterable[str]) -> str:
        return self.guard(lambda: parse_choice(name, default, choices), default)

    def url(self, name: str, default: str, schemes: Iterable[str]) -> str:
        return self.guard(lambda: parse_url(name, default, schemes), default)

    def list(self, name: str, default: list[str]) -> list[str]:
        return parse_list(name, default)

    def path(self, name: str, default: str) -> Path:
        return self.guard(lambda: parse_path(name, default), Path(default))

    def folder(self, name: str) -> Path | None:
        return self.guard(lambda: parse_folder(name), None)

    def stop(self) -> None:
        """End start-up with one line per bad variable, when there is one."""
        if self.errors:
            raise SystemExit("\n".join(f"ImproperlyConfigured: {error}" for error in self.errors))
