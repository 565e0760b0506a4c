"""The API's one parser. Apart from ptcproject.api: DRF's settings import it while APIView is being
defined, so it must not import rest_framework.views."""

from collections.abc import Mapping
from typing import Any

from rest_framework import exceptions
from rest_framework.parsers import JSONParser


class JsonParser(JSONParser):
    """DRF's JSON parser, but a body nested too deep for the decoder is a 400 ``parse_error``: the
    decoder raises RecursionError, which DRF's parser lets through as a 500."""

    def parse(self, stream: Any, media_type: str | None = None, parser_context: Mapping[str, Any] | None = None) -> Any:
        try:
            return super().parse(stream, media_type, parser_context)
        except RecursionError:
            raise exceptions.ParseError("JSON parse error - the body is nested too deep; send a flatter value.") from None
