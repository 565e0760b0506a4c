"""A call's arguments checked against its tool's input schema: jsonschema, its patterns bounded.

jsonschema matches ``pattern`` and ``patternProperties`` with Python's ``re``, which backtracks:
``^(a+)+$`` against 40 characters runs for days, holding the GIL of the process that checks (an
exec worker's bridge: every job on it). A tool's schema comes from whoever defined it (a job's own
client tools, a user's toolset, a remote MCP server), so here those keywords match with the
``regex`` module, which gives up after ``PATTERN_SECONDS`` (and all of a call's matches after
``PATTERNS_SECONDS``) and lets other threads run meanwhile. The whole check of a call ends after
``CHECK_SECONDS``, whatever its schema asks for.
``uniqueItems`` and ``enum`` are checked by looking each value up, not by comparing it with every
other item or every allowed value.
A schema whose checks can't finish (a pattern that gives up, a ``$ref`` that names nothing or
loops) fails the call, not the worker; so do arguments its checks overflow on.
"""

import functools
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from re import _constants as sre  # type: ignore[attr-defined]  # re's parser: private, absent from typeshed
from re import _parser as sre_parse  # type: ignore[attr-defined]
from typing import Any

import jsonschema
import regex
from jsonschema.exceptions import ValidationError
from referencing import Registry
from referencing.exceptions import Unresolvable

from tools.errors import ToolFailure

PATTERN_SECONDS = 0.1
# The most all of one call's matches may take: each item of a list is matched on its own, and 1,000
# items that each take a pattern just under PATTERN_SECONDS held the exec worker's bridge for minutes.
PATTERNS_SECONDS = 1.0
# The most the whole check of one call may take. A schema can make it as long as it likes: each
# of 30 definitions "any of the next, or the next" tries 2**30 ways to refuse a value, and held the
# exec worker's bridge for good (its job lost its lease). A megabyte of arguments that fits a plain
# schema is checked in under half a second. Well within a job's lease (PTC_JOB_LEASE_SECONDS: 45 s,
# 4 s in the tests): a job's lone call is checked on its bridge's loop, which renews the lease.
CHECK_SECONDS = 2.0
# The reasons weighed for the one a refusal gives (best_match): the first found. Arguments may miss
# their schema in as many ways as they have items (50,000 of them, each made into an error, took
# over a second), and which of the first is most relevant says as much as which of all.
ERRORS_WEIGHED = 100
# When the matches (``deadline``) and the whole check (``ends``) of the call this thread checks must
# end: ``arguments_error`` sets them.
_check = threading.local()


def _unchecked(why: str) -> ToolFailure:
    """The failure of a call whose arguments its tool's schema can't check, and ``why``."""
    return ToolFailure("invalid_arguments", f"the tool's input schema {why}; the call was not run")


# The most a pattern may be once its counted repeats are written out. regex compiles ``x{n}`` by
# writing ``x`` out n times, nested repeats multiplied, holding the GIL (its timeout is for the
# match only): (?:(?:a{100}){100}){100}, a million, froze every thread of the exec worker for 2 s and
# took 280 MB, and five deep of a{50} would for an hour. A hundred thousand compiles in a tenth of that.
PATTERN_SIZE = 100_000
_REPEATS = (sre.MAX_REPEAT, sre.MIN_REPEAT, sre.POSSESSIVE_REPEAT)


def _written_out(parsed: Any) -> int:
    """How many items ``parsed`` (re's parse of a pattern, or a part of one) is once its counted
    repeats are written out: a repeat is its body times its most (its least + 1 when unbounded)."""
    if isinstance(parsed, tuple | list):
        return sum(_written_out(part) for part in parsed)
    if not isinstance(parsed, sre_parse.SubPattern):
        return 0
    size = 0
    for op, value in parsed:
        if op in _REPEATS:
            least, most, body = value
            size += (least + 1 if most == sre.MAXREPEAT else most) * _written_out(body)
        else:
            size += 1 + _written_out(value)
    return size


@functools.lru_cache(maxsize=256)
def _too_large(pattern: str) -> bool:
    """Whether ``pattern`` is over PATTERN_SIZE written out, or can't be read (a schema's patterns
    were compiled with re when it was written: one that can't be now was never checked)."""
    try:
        return _written_out(sre_parse.parse(pattern)) > PATTERN_SIZE
    except (sre_parse.error, RecursionError, OverflowError):
        return True


def _shown(pattern: str) -> str:
    return repr(pattern if len(pattern) <= 80 else f"{pattern[:80]}...")


def pattern_problem(pattern: str) -> str | None:
    """Return why ``pattern`` can't be matched (``has a pattern (...) whose repeats make it too
    large``), or None if it can."""
    if not _too_large(pattern):
        return None
    return f"has a pattern ({_shown(pattern)}) whose repeats make it too large"


def schema_pattern_problem(schema: Any) -> str | None:
    """Return why a ``pattern`` or a ``patternProperties`` key anywhere in ``schema`` can't be
    matched, or None if each can. A schema is checked with this when it is written, so one that
    could check no call is refused there, not by every call of its tool (``_search``)."""
    patterns = [value for value in keyword_values(schema, "pattern") if isinstance(value, str)]
    patterns += [key for value in keyword_values(schema, "patternProperties") if isinstance(value, dict) for key in value]
    return next((why for pattern in patterns if (why := pattern_problem(pattern)) is not None), None)


def _search(pattern: str, text: str) -> bool:
    if (why := pattern_problem(pattern)) is not None:
        raise _unchecked(why)
    deadline = getattr(_check, "deadline", None)
    left = PATTERN_SECONDS if deadline is None else min(PATTERN_SECONDS, deadline - time.monotonic())
    try:
        if left <= 0:
            raise TimeoutError
        return regex.search(pattern, text, timeout=left, concurrent=True) is not None
    except TimeoutError:
        if left < PATTERN_SECONDS:
            raise _unchecked(f"has patterns that took over {PATTERNS_SECONDS:g} s in all to match these arguments") from None
        raise _unchecked(f"has a pattern ({_shown(pattern)}) that took over {PATTERN_SECONDS:g} s to match") from None


# jsonschema's own keywords, with their matches made by _search: (validator, the keyword's value,
# the instance, the schema) -> the instance's errors.
Errors = Iterator[ValidationError]


def _pattern(validator: Any, pattern: str, instance: Any, schema: dict[str, Any]) -> Errors:
    if validator.is_type(instance, "string") and not _search(pattern, instance):
        yield ValidationError(f"{instance!r} does not match {pattern!r}")


def _pattern_properties(validator: Any, patterns: dict[str, Any], instance: Any, schema: dict[str, Any]) -> Errors:
    if not validator.is_type(instance, "object"):
        return
    for pattern, subschema in patterns.items():
        for key, value in instance.items():
            if _search(pattern, key):
                yield from validator.descend(value, subschema, path=key, schema_path=pattern)


def _additional_properties(validator: Any, additional: Any, instance: Any, schema: dict[str, Any]) -> Errors:
    if not validator.is_type(instance, "object"):
        return
    known, patterns = schema.get("properties", {}), schema.get("patternProperties", {})
    extras = [key for key in instance if key not in known and not any(_search(p, key) for p in patterns)]
    if validator.is_type(additional, "object"):
        for extra in extras:
            yield from validator.descend(instance[extra], additional, path=extra)
    elif not additional and extras:
        listed = ", ".join(repr(extra) for extra in sorted(extras, key=str))
        yield ValidationError(f"Additional properties are not allowed ({listed} unexpected)")


def _unique_items(validator: Any, unique: Any, instance: Any, schema: dict[str, Any]) -> Errors:
    # jsonschema compares items pairwise when they don't sort (objects): 12,000 of them, 200 KB of
    # arguments, are 72 million comparisons, and starved the exec worker of its lease. Here each
    # item is keyed by its value, once.
    if not unique or not validator.is_type(instance, "array"):
        return
    seen: dict[Any, int] = {}
    for index, item in enumerate(instance):
        first = seen.setdefault(_unique_key(item), index)
        if first != index:
            yield ValidationError(f"has non-unique elements: items {first} and {index} are equal")
            return


def _unique_key(value: Any) -> Any:
    """A hashable key equal for JSON values JSON Schema calls equal: 1 and 1.0 are, true and 1 are
    not (Python's bool is an int), objects and arrays by their items. Arguments nest no deeper than
    MAX_JSON_DEPTH (checked before the schema), so this recursion ends."""
    if isinstance(value, bool):
        return (bool, value)
    if isinstance(value, dict):
        return (dict, frozenset((key, _unique_key(item)) for key, item in value.items()))
    if isinstance(value, list | tuple):
        return (list, tuple(_unique_key(item) for item in value))
    if isinstance(value, int | float):
        # By its digits, whose hash is random per process: an int's is its value mod 2**61 - 1, so
        # numbers chosen to share one made each lookup compare with all the others (20,000: 2.8 s).
        return (float, str(int(value)) if isinstance(value, int) or value.is_integer() else repr(value))
    return value


def _enum(known: dict[int, Any], original: Any, validator: Any, enums: Any, instance: Any, schema: dict[str, Any]) -> Errors:
    # jsonschema compares each value with every one of the enum's, and words each miss with the
    # whole enum's repr: 100,000 items against 5,000 values starved the exec worker of its lease.
    # Here each enum's values are keyed once, in ``known`` (by the list's id: the list is kept there
    # too, so the id stays its own), and each value is looked up.
    if not isinstance(enums, list):
        yield from original(validator, enums, instance, schema)
        return
    if id(enums) not in known:
        known[id(enums)] = (enums, frozenset(_unique_key(value) for value in enums))
    if _unique_key(instance) not in known[id(enums)][1]:
        shown = repr(enums) if len(enums) <= 10 else f"the {len(enums)} values allowed: {repr(enums[:5])[:-1]}, ...]"
        yield ValidationError(f"{instance!r} is not one of {shown}")


def _unevaluated_refused(validator: Any, unevaluated: Any, instance: Any, schema: dict[str, Any]) -> None:
    # jsonschema finds the properties a schema evaluated with ``re``, through every subschema and
    # reference: with patternProperties anywhere, the combination is refused rather than rewritten.
    raise _unchecked("uses unevaluatedProperties with patternProperties, which PTC does not check")


_BOUNDED: dict[str, Callable[..., Errors]] = {
    "pattern": _pattern,
    "patternProperties": _pattern_properties,
    "additionalProperties": _additional_properties,
    "uniqueItems": _unique_items,
}


def keyword_values(schema: Any, key: str) -> Iterator[Any]:
    """Yield the value of every ``key`` anywhere in ``schema`` (its subschemas, definitions, lists)."""
    if isinstance(schema, dict):
        if key in schema:
            yield schema[key]
        for value in schema.values():
            yield from keyword_values(value, key)
    elif isinstance(schema, list):
        for value in schema:
            yield from keyword_values(value, key)


def _anywhere(schema: Any, key: str) -> bool:
    return any(True for _ in keyword_values(schema, key))


def _in_time(check: Callable[..., Any]) -> Callable[..., Any]:
    """``check`` (a keyword's), refused once its call's check is past ``CHECK_SECONDS``: every
    keyword of every subschema the check reaches goes through here, so no schema outlasts it."""

    def timed(validator: Any, value: Any, instance: Any, schema: Any) -> Any:
        ends = getattr(_check, "ends", None)
        if ends is not None and time.monotonic() > ends:
            raise _unchecked(f"took over {CHECK_SECONDS:g} s to check these arguments")
        return check(validator, value, instance, schema)

    return timed


def arguments_validator(schema: dict[str, Any]) -> Any:
    """Return a validator of arguments for ``schema``: its draft's, its pattern, uniqueItems and enum
    keywords bounded, and every keyword within the check's time."""
    base = jsonschema.validators.validator_for(schema)
    bounded: dict[str, Callable[..., Any]] = {name: check for name, check in _BOUNDED.items() if name in base.VALIDATORS}
    if "enum" in base.VALIDATORS:
        bounded["enum"] = functools.partial(_enum, {}, base.VALIDATORS["enum"])  # keyed once for this validator
    if "unevaluatedProperties" in base.VALIDATORS and _anywhere(schema, "unevaluatedProperties"):
        if _anywhere(schema, "patternProperties"):
            bounded["unevaluatedProperties"] = _unevaluated_refused
    checks = {name: _in_time(bounded.get(name, check)) for name, check in base.VALIDATORS.items()}
    cls = jsonschema.validators.extend(base, checks)
    # A registry of ours (jsonschema adds the drafts' own schemas to it) that fetches nothing: its
    # default fetched any other $ref with urlopen, no timeout, from the process that checks (an exec
    # worker's bridge), so a job's client tool made the worker GET any URL. Such a $ref names nothing.
    return cls(schema, format_checker=base.FORMAT_CHECKER, registry=Registry())


def arguments_error(validator: Any, arguments: Any) -> ValidationError | None:
    """Return the most relevant reason ``arguments`` don't match, or None if they do. Raise
    ToolFailure ``invalid_arguments`` if the schema's checks can't finish."""
    now = time.monotonic()
    _check.deadline, _check.ends = now + PATTERNS_SECONDS, now + CHECK_SECONDS
    try:
        return jsonschema.exceptions.best_match(itertools.islice(validator.iter_errors(arguments), ERRORS_WEIGHED))
    except Unresolvable as exc:
        raise _unchecked(f"has a $ref that names nothing ({exc})") from None
    except RecursionError:
        raise _unchecked("refers to itself without end ($ref)") from None
    except OverflowError as exc:
        # Arguments a check can't take: ``format: regex`` compiling ``a{99999999999}``, or
        # ``multipleOf: 0.5`` dividing 10**400 as a float. Not the caller's bridge failing.
        raise ToolFailure(
            "invalid_arguments", f"the arguments can't be checked against the tool's input schema ({exc}); the call was not run"
        ) from None
    finally:
        _check.deadline = _check.ends = None
