"""Serializer fields every app's input shares: numbers that are numbers, text that is text, JSON
values that readers can walk without running out of stack, and bodies without unknown keys."""

from collections.abc import Mapping
from typing import Any

from drf_spectacular.extensions import OpenApiSerializerExtension
from drf_spectacular.plumbing import get_doc
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


class KeyUuidField(serializers.UUIDField):
    """A client's key of its own (an ``idempotency_key``): a UUID sent as a string, in any form
    ``uuid.UUID`` reads. DRF's UUIDField takes a number too (``12345`` is ``UUID(int=12345)``), and
    the nil and max UUIDs (all zeros, all ones), which no client makes for one request: every client
    that sent one shared one key, and a second grant of theirs was answered with the first's."""

    default_error_messages = {
        "not_text": "Send a UUID as a string, not {kind}.",
        "shared": "The nil and max UUIDs are no key of one request's: send a new random UUID (uuid4) for each.",
    }

    def to_internal_value(self, data: Any) -> Any:
        if not isinstance(data, str):
            self.fail("not_text", kind=type(data).__name__)
        value = super().to_internal_value(data)
        if value.int in (0, (1 << 128) - 1):
            self.fail("shared")
        return value


class JsonValueField(serializers.JSONField):
    """Any JSON value nested at most MAX_JSON_DEPTH levels: deeper ones would overflow the stack of
    the code that reads them (json, jsonschema), so they are refused before anything walks them."""

    default_error_messages = {"too_deep": f"Nested deeper than {MAX_JSON_DEPTH} levels; send a flatter value."}

    def to_internal_value(self, data: Any) -> Any:
        if json_depth_exceeds(data):
            self.fail("too_deep")
        return super().to_internal_value(data)


# How many unknown keys a refusal names: enough to find a misspelling, not the whole of a hostile body.
UNKNOWN_NAMED = 10


class KnownKeysOnly:
    """A request body whose every key is one of its fields, mixed into a serializer before DRF's own
    class. DRF drops keys it does not know, and a misspelled one then leaves its field at the
    default without a word: ``max_credit`` leaves the job uncapped, ``toolset`` grants every
    toolset. Each unknown key is a field error instead. ``also_known`` names keys that are accepted
    and ignored: those of the resource as it is read, so what GET answered can be sent back."""

    also_known: frozenset[str] = frozenset()
    fields: Any  # the serializer's

    def to_internal_value(self, data: Any) -> Any:
        unknown = {}
        if isinstance(data, Mapping):
            fields = self.fields
            names = sorted(str(key) for key in data if key not in fields and key not in self.also_known)
            if names:
                known = ", ".join(name for name, field in fields.items() if not field.read_only)
                unknown = {name[:64]: [f"Unknown field: not one of {known}."] for name in names[:UNKNOWN_NAMED]}
        try:
            value = super().to_internal_value(data)  # type: ignore[misc]
        except serializers.ValidationError as exc:  # every problem in one answer
            if unknown and isinstance(exc.detail, dict):
                raise serializers.ValidationError({**exc.detail, **unknown}) from None
            raise
        if unknown:
            raise serializers.ValidationError(unknown)
        return value


class KnownKeysOnlySchema(OpenApiSerializerExtension):
    """The OpenAPI document says so of each such request body: ``additionalProperties: false``."""

    target_class = KnownKeysOnly
    match_subclasses = True

    def map_serializer(self, auto_schema: Any, direction: str) -> dict[str, Any]:
        schema = auto_schema._map_serializer(self.target, direction, bypass_extensions=True)
        # A serializer without a docstring of its own is described by its bases' first: this
        # mixin's, which tells this code's readers how it works, not an API's what a body is.
        if schema.get("description") == get_doc(KnownKeysOnly):
            del schema["description"]
        if direction == "request":
            schema["additionalProperties"] = False
        return schema
