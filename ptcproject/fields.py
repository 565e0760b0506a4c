"""Serializer fields every app's input shares: numbers that are numbers, text that is text, and JSON
values that readers can walk without running out of stack."""

from typing import Any

from rest_framework import serializers

from ptcproject.storage import MAX_JSON_DEPTH, json_depth_exceeds


class NumberField(serializers.FloatField):
    """A float that must be sent as a number (or a numeric string): ``true`` is not 1."""

    def to_internal_value(self, data: Any) -> float:
        if isinstance(data, bool):
            self.fail("invalid")
        return super().to_internal_value(data)


# The most names one request's list may hold (toolsets; a policy's lists of users, toolsets and
# tools): far above any real one, and far below PostgreSQL's 65,535 parameters of one statement,
# past which its lookup failed as if the database were down (503, "try again").
MAX_NAMES = 10_000


class NamesField(serializers.ListField):
    """A list of names (toolset keys, usernames, tool names), each at most ``max_name`` characters,
    and at most MAX_NAMES of them."""

    def __init__(self, *, max_name: int, **kwargs: Any) -> None:
        super().__init__(child=serializers.CharField(max_length=max_name), max_length=MAX_NAMES, **kwargs)


class TextField(serializers.CharField):
    """A string that must be sent as one: DRF's CharField turns ``123`` into ``"123"``, and code sent
    as a number would run as that number's digits."""

    default_error_messages = {"not_text": "Send a string, not {kind}."}

    def to_internal_value(self, data: Any) -> str:
        if not isinstance(data, str):
            self.fail("not_text", kind=type(data).__name__)
        return super().to_internal_value(data)


class JsonValueField(serializers.JSONField):
    """Any JSON value nested at most MAX_JSON_DEPTH levels: deeper ones would overflow the stack of
    the code that reads them (json, jsonschema), so they are refused before anything walks them."""

    default_error_messages = {"too_deep": f"Nested deeper than {MAX_JSON_DEPTH} levels; send a flatter value."}

    def to_internal_value(self, data: Any) -> Any:
        if json_depth_exceeds(data):
            self.fail("too_deep")
        return super().to_internal_value(data)
