"""A process's few last-built things, by key, shared by its threads."""

import threading
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class Kept(Generic[K, V]):
    """The last ``size`` values put, by key: a put past ``size`` drops the oldest."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._items: dict[K, V] = {}
        self._lock = threading.Lock()

    def get(self, key: K) -> V | None:
        with self._lock:
            return self._items.get(key)

    def put(self, key: K, value: V) -> None:
        with self._lock:
            if key not in self._items and len(self._items) >= self.size:
                self._items.pop(next(iter(self._items)))
            self._items[key] = value
