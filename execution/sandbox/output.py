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
