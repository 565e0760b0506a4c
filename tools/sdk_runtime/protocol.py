"""The bridge's wire format: length-prefixed JSON frames over a unix socketpair.

Standard library only: this file is used by the worker and, copied as ``ptc_tools/_protocol.py``,
inside the sandbox.

A frame is a 4-byte big-endian length, then that many bytes of UTF-8 JSON holding one object.
"""

import base64
import struct
import zlib

# Bound as the runner imports this, before the code runs: code that replaces json.dumps or
# json.loads (to encode its own types, say) can't break the bridge, nor the SDK's other readers.
from json import dumps as json_dumps
from json import loads as json_loads
from typing import Any

HEADER = struct.Struct(">I")
DEFAULT_MAX_FRAME = 8 * 1024 * 1024


def nests_deeper(value: Any, limit: int) -> bool:
    """Return True if lists or dicts in ``value`` nest more than ``limit`` deep. Iterative: a value
    too deep for json, DRF or jsonschema (which recurse) is found without recursing."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list | tuple) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list | tuple))
    return False


class FrameError(Exception):
    """The peer sent something that is not a valid frame. The connection cannot be trusted after."""


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def encode(message: dict[str, Any]) -> bytes:
    """Return ``message`` as one frame. Raise ValueError if it is not strict JSON."""
    try:
        body = json_dumps(message, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()
    except UnicodeEncodeError:  # a lone surrogate: JSON can still carry it, escaped
        body = json_dumps(message, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()
    return HEADER.pack(len(body)) + body


def pack(data: bytes) -> str:
    """Bytes as a frame carries them: zlib-compressed, then base64 (an SDK file and its bytecode)."""
    return base64.b64encode(zlib.compress(data)).decode()


def unpack(data: str) -> bytes:
    """The bytes ``pack`` made ``data`` of."""
    return zlib.decompress(base64.b64decode(data))


class FrameDecoder:
    """Turns a byte stream into messages; ``feed`` returns every whole frame received so far."""

    def __init__(self, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        self.max_frame = max_frame
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        return [message for message, _ in self.feed_sized(data)]

    def feed_sized(self, data: bytes) -> list[tuple[dict[str, Any], int]]:
        """``feed``, each message with its frame's size in bytes."""
        self._buffer += data
        messages = []
        while len(self._buffer) >= HEADER.size:
            (size,) = HEADER.unpack_from(self._buffer)
            if size > self.max_frame:
                raise FrameError(f"frame of {size} bytes is over the {self.max_frame}-byte limit")
            if len(self._buffer) < HEADER.size + size:
                break
            body = bytes(self._buffer[HEADER.size : HEADER.size + size])
            del self._buffer[: HEADER.size + size]
            try:
                message = json_loads(body, parse_constant=_reject_constant)
            except (ValueError, UnicodeDecodeError) as exc:
                raise FrameError(f"frame is not valid JSON: {exc}") from None
            except RecursionError:
                raise FrameError("frame's JSON is nested too deep to read") from None
            if not isinstance(message, dict):
                raise FrameError("frame is not a JSON object")
            messages.append((message, size))
        return messages

    @property
    def pending_bytes(self) -> int:
        return len(self._buffer)
