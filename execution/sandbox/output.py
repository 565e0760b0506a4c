import re

# What ends a job's live output (its stdout or stderr events) once it has streamed as much as the
# job keeps: exec_end has the tail (``tail_of``).
LIVE_CUT = "[output truncated here; exec_end has its tail]"
# What CappedOutput.text puts between the head and the tail it keeps.
_OMITTED = re.compile(r"\n…\[[0-9]+ bytes omitted\]…\n")


def tail_of(text: str) -> str:
    """Return the tail of an output kept truncated (CappedOutput.text): what follows its marker."""
    marker = _OMITTED.search(text)
    return text[marker.end() :] if marker else ""


class CappedOutput:
    """Collects a stream up to ``limit`` bytes, keeping its head and its tail, never the middle."""

    def __init__(self, limit: int) -> None:
        self.limit = max(limit, 2)
        self._half = self.limit // 2
        self._head = bytearray()
        self._tail = bytearray()
        self.total = 0

    def feed(self, data: bytes) -> None:
        self.total += len(data)
        room = self._half - len(self._head)
        if room > 0:
            self._head += data[:room]
            data = data[room:]
        if data:
            self._tail += data
            if len(self._tail) > 2 * self._half:  # trim in bulk, so 1 GB of output costs O(n)
                del self._tail[: len(self._tail) - self._half]

    @property
    def truncated(self) -> bool:
        return self.total > self.limit

    def text(self) -> str:
        if not self.truncated:
            return (bytes(self._head) + bytes(self._tail)).decode("utf-8", "replace")
        tail = bytes(self._tail[-self._half :])
        omitted = self.total - len(self._head) - len(tail)
        marker = f"\n…[{omitted} bytes omitted]…\n"
        return bytes(self._head).decode("utf-8", "replace") + marker + tail.decode("utf-8", "replace")
