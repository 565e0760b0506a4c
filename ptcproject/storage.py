"""Making values fit the database: PostgreSQL text and jsonb hold neither NUL nor lone surrogates,
and a value nested too deep would overflow the stack of every reader that recurses (json, DRF,
jsonschema). Both are handled here without recursion, so no value can break the writer itself."""

import math
from typing import Any

from tools.sdk_runtime.protocol import nests_deeper

# How deep a stored JSON value (a tool's arguments or output, a job's return value) may nest.
MAX_JSON_DEPTH = 100
TOO_DEEP = f"<nested deeper than {MAX_JSON_DEPTH} levels: cut here>"

# The integer columns' ranges on PostgreSQL. A value outside them is refused as input: sent to the
# database, it would be an error there (a 500), not a field error.
POSITIVE_INT_MAX = 2**31 - 1  # PositiveIntegerField: integer with a CHECK >= 0
BIGINT_MIN, BIGINT_MAX = -(2**63), 2**63 - 1  # BigIntegerField


def _text(value: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates, e.g. from a str built out of raw escapes
        value = value.encode("utf-8", "replace").decode("utf-8")
    return value.replace("\x00", "\ufffd") if "\x00" in value else value


def unstorable(value: Any) -> str | None:
    """Say what of ``value`` ``storable`` would have to change, where (``path: what``), or None: a
    string or key with a NUL or a lone surrogate, a float that is NaN or infinite. Iterative; the
    depth is ``json_depth_exceeds``'s to check. The path is spelled out only for a problem found:
    every call's arguments go through this."""
    # Each item with where it is: None at the top, else (where its parent is, its key, whether it is the key).
    stack: list[tuple[Any, Any]] = [(value, None)]
    while stack:
        item, where = stack.pop()
        problem = None
        if isinstance(item, str):
            if "\x00" in item:
                problem = "holds a NUL character (U+0000), which can't be stored"
            else:
                try:
                    item.isascii() or item.encode("utf-8")  # the former, without a copy, for most
                except UnicodeEncodeError:
                    problem = "holds a lone surrogate, which is not text"
        elif isinstance(item, float) and not math.isfinite(item):
            problem = f"{item} is not a JSON number"
        elif isinstance(item, dict):
            for k, v in item.items():
                stack.extend([(str(k), (where, k, True)), (v, (where, k, False))])
        elif isinstance(item, list | tuple):
            stack.extend((v, (where, i, False)) for i, v in enumerate(item))
        if problem:
            return f"{_path(where) or ('a string' if isinstance(item, str) else 'a number')}: {problem}"
    return None


def _path(where: Any) -> str:
    """``a/b/0``, or ``a/b (a key)``, for a place ``unstorable`` tracks; "" at the top."""
    parts: list[str] = []
    is_key = bool(where and where[2])
    while where is not None:
        where, key, _ = where
        parts.append(str(key))
    return "/".join(reversed(parts)) + (" (a key)" if is_key else "")


def json_depth_exceeds(value: Any, limit: int = MAX_JSON_DEPTH) -> bool:
    """Return True if ``value`` has lists or dicts nested more than ``limit`` deep. Iterative."""
    return nests_deeper(value, limit)


def storable(value: Any) -> Any:
    """Return ``value`` safe to store, without recursion: every string (keys included) valid UTF-8
    without NUL (it becomes U+FFFD), non-finite floats as their names, and any list or dict nested
    deeper than MAX_JSON_DEPTH replaced by the string TOO_DEEP."""
    holder: list[Any] = [None]
    stack: list[tuple[Any, Any, Any, int]] = [(value, holder, 0, 1)]  # (value, parent, key in parent, depth)
    while stack:
        item, parent, key, depth = stack.pop()
        if isinstance(item, str):
            parent[key] = _text(item)
        elif isinstance(item, float) and not math.isfinite(item):
            parent[key] = str(item)
        elif isinstance(item, dict | list | tuple) and depth > MAX_JSON_DEPTH:
            parent[key] = TOO_DEEP
        elif isinstance(item, dict):
            target: dict[str, Any] = {}
            parent[key] = target
            for k, v in item.items():
                name = _text(str(k))
                target[name] = None  # keeps the keys' order; filled in from the stack
                stack.append((v, target, name, depth + 1))
        elif isinstance(item, list | tuple):
            items: list[Any] = [None] * len(item)
            parent[key] = items
            stack.extend((v, items, i, depth + 1) for i, v in enumerate(item))
        else:
            parent[key] = item
    return holder[0]
