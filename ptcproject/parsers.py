"""The API's one parser, and its content negotiation. Apart from ptcproject.api: DRF's settings
import both while APIView is being defined, so this must not import rest_framework.views."""

import codecs
import io
import json
import re
from collections.abc import Iterable, Mapping
from typing import Any

from django.conf import settings
from rest_framework import exceptions
from rest_framework.negotiation import DefaultContentNegotiation
from rest_framework.parsers import JSONParser
from rest_framework.renderers import BaseRenderer

# A \u escape of a surrogate (half of a pair, as ensure_ascii writes an emoji, or one alone).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


class JsonParser(JSONParser):
    """DRF's JSON parser, but these are a 400 ``parse_error``, not a 500 later:

    - a body nested too deep for the decoder (it raises RecursionError, which DRF's parser lets
      through);
    - a lone surrogate (``"\\ud800"``): JSON's escapes allow one, but no text holds one. It would
      reach PostgreSQL (which refuses it in a JSON column) or an error message echoing it (which
      can't be encoded)."""

    def parse(self, stream: Any, media_type: str | None = None, parser_context: Mapping[str, Any] | None = None) -> Any:
        body = stream.read()  # as json.load would: the body is read whole
        encoding = str((parser_context or {}).get("encoding") or settings.DEFAULT_CHARSET)
        # The escapes are looked for in the bytes only when they are UTF-8's (or ASCII's); a body
        # in another charset (UTF-16 has NULs between its characters) is checked whole.
        try:
            utf8 = codecs.lookup(encoding).name in ("utf-8", "ascii")
        except LookupError:
            raise exceptions.ParseError("JSON parse error - the body's charset is not one this server knows.") from None
        try:
            data = super().parse(io.BytesIO(body), media_type, parser_context)
            alone = (not utf8 or _SURROGATE_ESCAPE.search(body) is not None) and _has_lone_surrogate(data)
        except RecursionError:
            raise exceptions.ParseError("JSON parse error - the body is nested too deep; send a flatter value.") from None
        if alone:
            raise exceptions.ParseError(
                "JSON parse error - the body holds a lone surrogate (\\ud800-\\udfff): send valid Unicode."
            )
        return data


def _has_lone_surrogate(data: Any) -> bool:
    """Whether a parsed body holds a surrogate in a key or a string (a pair was decoded into one
    character: any left is alone). Only for a body with such escapes: it encodes the whole value."""
    try:
        json.dumps(data, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return True
    return False


class ContentNegotiation(DefaultContentNegotiation):
    """DRF's, where a ``?format=`` that no renderer gives is a 406, as an ``Accept`` header that
    none can meet is; DRF answers 404, as if what was asked for did not exist."""

    def filter_renderers(self, renderers: Iterable[BaseRenderer], format: str) -> list[BaseRenderer]:
        renderers = list(renderers)
        kept = [renderer for renderer in renderers if renderer.format == format]
        if not kept:
            formats = ", ".join(str(renderer.format) for renderer in renderers)
            raise exceptions.NotAcceptable(f"format must be one of: {formats}")  # not echoed: it may be anything
        return kept
