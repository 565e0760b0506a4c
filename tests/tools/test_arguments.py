"""A call's arguments against its tool's schema: jsonschema's checks, none that can run unbounded."""

import gc
import time
from typing import Any

import pytest

from tools.arguments import PATTERN_SECONDS, arguments_error, arguments_validator
from tools.errors import ToolFailure


def _error(schema: dict[str, Any], arguments: dict[str, Any]) -> str | None:
    error = arguments_error(arguments_validator(schema), arguments)
    return None if error is None else error.message


def _refused(schema: dict[str, Any], arguments: dict[str, Any]) -> str:
    with pytest.raises(ToolFailure) as failure:
        arguments_error(arguments_validator(schema), arguments)
    assert failure.value.code == "invalid_arguments"
    return failure.value.message


def test_patterns_match_as_jsonschemas_do() -> None:
    schema = {
        "type": "object",
        "properties": {"slug": {"type": "string", "pattern": "^[a-z]+(-[a-z]+)*$"}},
        "patternProperties": {"^x_": {"type": "integer"}},
        "additionalProperties": False,
    }
    assert _error(schema, {"slug": "a-b", "x_1": 1}) is None
    assert _error(schema, {"slug": "A"}) == "'A' does not match '^[a-z]+(-[a-z]+)*$'"
    assert _error(schema, {"x_1": "one"}) == "'one' is not of type 'integer'"
    assert _error(schema, {"other": 1}) == "Additional properties are not allowed ('other' unexpected)"
    nested = {"type": "object", "additionalProperties": {"type": "string"}, "patternProperties": {"^n": {"type": "number"}}}
    assert _error(nested, {"n1": 1, "s": "t"}) is None
    assert _error(nested, {"s": 1}) == "1 is not of type 'string'"


@pytest.mark.parametrize("where", ["pattern", "patternProperties"])
def test_a_pattern_that_backtracks_without_end_fails_the_call_in_bounded_time(where: str) -> None:
    # Python's re takes hours on this; the worker that checks would hold its GIL all along.
    evil = "^(a|aa)+$"
    if where == "pattern":
        schema, arguments = {"type": "object", "properties": {"s": {"type": "string", "pattern": evil}}}, {"s": "a" * 60 + "!"}
    else:
        schema, arguments = {"type": "object", "patternProperties": {evil: {}}}, {"a" * 60 + "!": 1}
    started = time.monotonic()
    assert "took over" in _refused(schema, arguments)
    assert time.monotonic() - started < PATTERN_SECONDS * 10


def test_a_pattern_whose_repeats_nest_too_large_is_refused_before_it_is_compiled() -> None:
    # regex writes a counted repeat's body out that many times as it compiles, nested ones
    # multiplied, holding the GIL: this one, a million, froze every thread of the exec worker for
    # 2 s and took 280 MB; five deep of a{50}, within a client tool's limits, for an hour and gigabytes.
    nested = "^(?:(?:a{100}){100}){100}$"
    started = time.monotonic()
    refused = _refused({"type": "object", "properties": {"s": {"type": "string", "pattern": nested}}}, {"s": "x"})
    assert time.monotonic() - started < 0.5
    assert refused == f"the tool's input schema has a pattern ({nested!r}) whose repeats make it too large; the call was not run"
    keys = _refused({"type": "object", "patternProperties": {nested: {}}}, {"k": 1})
    assert "whose repeats make it too large" in keys
    # As large as real patterns get, and larger: still matched.
    host = "^(?:[a-z0-9-]{1,63}\\.){1,10}[a-z]{2,}$"
    assert _error({"type": "object", "properties": {"s": {"pattern": host}}}, {"s": "a.b.io"}) is None
    assert _error({"type": "object", "properties": {"s": {"pattern": "^a{1,60000}$"}}}, {"s": "b"}) is not None


def test_a_schema_that_cannot_be_applied_fails_the_call_saying_why() -> None:
    # What earlier tests left to the collector (a socket, say) is finalized now, at a shallow stack:
    # run deep in this test's recursion, a finalizer's warning could not even be reported.
    gc.collect()
    properties = lambda ref: {"type": "object", "properties": {"a": {"$ref": ref}}}  # noqa: E731
    assert "names nothing" in _refused(properties("#/nope"), {"a": 1})
    assert "names nothing" in _refused(properties("http://127.0.0.1:9/schema"), {"a": 1})  # never fetched
    assert "without end" in _refused(properties("#/properties/a"), {"a": 1})
    unevaluated = {"type": "object", "patternProperties": {"^p": {}}, "unevaluatedProperties": False}
    assert "unevaluatedProperties with patternProperties" in _refused(unevaluated, {"p": 1})
    assert _error({"type": "object", "properties": {"p": {}}, "unevaluatedProperties": False}, {"q": 1}) is not None
