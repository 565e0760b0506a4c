"""A body in a Content-Encoding, inflated a bounded piece at a time.

httpx (and httpx2, for a whole body it reads) inflates what a server sent as it came: 64 KiB of
gzip are 64 MiB, and a few hundred bytes of gzip over gzip are gigabytes. Here each step inflates
at most ``PIECE`` bytes, and only when the reader takes the one before: what a reader stops
taking is never inflated.
"""

import zlib
from collections.abc import Iterator

# The codings undone, as zlib's ``wbits``: those httpx 0.28.1 decodes without the brotli and
# zstandard packages, and all a client of ours asks for (ACCEPT_ENCODING).
CODINGS = {"gzip": zlib.MAX_WBITS | 16, "deflate": zlib.MAX_WBITS}
ACCEPT_ENCODING = ", ".join(CODINGS)
# The most one step inflates.
PIECE = 64 << 10
# The most codings undone, one over the other: a server sends one, and each is a step of its own
# for every piece (2,000 of them, in a header of 12 KB, were 2,000 steps deep).
MAX_CODINGS = 4


class DecodingError(ValueError):
    """A body not in the coding it says it is in."""


class Inflater:
    """One coding of one body, undone as its bytes come (``feed``)."""

    def __init__(self, coding: str) -> None:
        self._coding = coding
        self._zlib = zlib.decompressobj(CODINGS[coding])
        self._first = True

    @property
    def eof(self) -> bool:
        """True once the coded stream ended: what follows it is dropped, as httpx drops it."""
        return self._zlib.eof

    def feed(self, data: bytes) -> Iterator[bytes]:
        """Yield ``data`` inflated, in pieces of at most ``PIECE`` bytes. Raise DecodingError."""
        while not self._zlib.eof:
            try:
                piece = self._zlib.decompress(data, PIECE)
            except zlib.error as exc:
                if self._first and self._coding == "deflate":  # as httpx: a raw deflate stream, without zlib's header
                    self._zlib, self._first = zlib.decompressobj(-zlib.MAX_WBITS), False
                    continue
                raise DecodingError(str(exc)) from None
            self._first = False
            if piece:
                yield piece
            data = self._zlib.unconsumed_tail
            # A full piece may leave output pending inside zlib even when all input was taken.
            if not data and len(piece) < PIECE:
                return


class _Refusing(Inflater):
    """A body in more codings than are undone: its first piece is a DecodingError."""

    def __init__(self, why: str) -> None:
        self._why = why

    @property
    def eof(self) -> bool:
        return False

    def feed(self, data: bytes) -> Iterator[bytes]:
        raise DecodingError(self._why)


def inflaters(codings: list[str]) -> list[Inflater]:
    """Return the inflaters of a body whose Content-Encoding names ``codings`` (split at commas), in
    the order they undo them: the last applied first. A coding not known is passed over, as httpx
    passes it over (Response._get_content_decoder), and the body read as it came. Past MAX_CODINGS,
    one that refuses the body: reading it raises DecodingError."""
    known = [name for name in (c.strip().lower() for c in codings) if name in CODINGS]
    if len(known) > MAX_CODINGS:
        return [_Refusing(f"the Content-Encoding names {len(known)} codings; at most {MAX_CODINGS} are undone")]
    return [Inflater(c) for c in reversed(known)]


def inflated(data: bytes, chain: list[Inflater]) -> Iterator[bytes]:
    """Yield ``data`` (a piece of the body as it came) through ``chain``, each piece at most
    ``PIECE`` bytes, each made only when the reader takes the one before."""
    if not chain:
        if data:
            yield data
        return
    for piece in chain[0].feed(data):
        yield from inflated(piece, chain[1:])
