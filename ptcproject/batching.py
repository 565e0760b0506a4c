"""Group commit: concurrent callers' items done together, in one round trip, by one of them.

A caller that finds nothing running does its item at once, on its own thread, with whatever else
is waiting: a lone call pays no hand-off and no wait. Callers that arrive while a batch runs wait
for the next one, which the first of them leads when the running batch is done. So a burst of
tool calls on a tools worker's threads (a fan-out finishing together) costs a few statements
instead of one statement each, on one GIL and one database.
"""

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

Item = TypeVar("Item")
Out = TypeVar("Out")


class _Slot(Generic[Item, Out]):
    __slots__ = ("done", "error", "item", "lead", "out")

    def __init__(self, item: Item) -> None:
        self.item = item
        self.out: Out | None = None
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.lead = False


class GroupCommit(Generic[Item, Out]):
    """Call ``run(items)`` (which returns one output per item, in order) on batches of at most
    ``most`` items. An exception from ``run`` is raised to every caller of its batch."""

    def __init__(self, run: Callable[[list[Item]], list[Out]], most: int = 100) -> None:
        self.run = run
        self.most = most
        self._lock = threading.Lock()
        self._waiting: list[_Slot[Item, Out]] = []
        self._busy = False

    def __call__(self, item: Item) -> Out:
        slot: _Slot[Item, Out] = _Slot(item)
        with self._lock:
            self._waiting.append(slot)
            slot.lead = not self._busy
            self._busy = True
        if not slot.lead:
            slot.done.wait()  # set when our batch is done, or when we are to lead the next one
        if slot.lead:
            self._lead()
        if slot.error is not None:
            raise slot.error
        return slot.out  # type: ignore[return-value]  # set by the batch that ran it

    def _lead(self) -> None:
        """Run a batch of what is waiting (our own slot first: a leader is always first in line),
        hand the results out, and pass the lead to the first slot still waiting."""
        with self._lock:
            batch, self._waiting = self._waiting[: self.most], self._waiting[self.most :]
        try:
            outs = self.run([slot.item for slot in batch])
            if len(outs) != len(batch):
                raise RuntimeError(f"a batch of {len(batch)} gave {len(outs)} results")
            for slot, out in zip(batch, outs, strict=True):
                slot.out = out
        except BaseException as exc:  # every caller of the batch raises it, on its own thread
            for slot in batch:
                slot.error = exc
        finally:
            with self._lock:
                after = self._waiting[0] if self._waiting else None
                if after is None:
                    self._busy = False
                else:
                    after.lead = True
            for slot in batch:
                slot.lead = False
                slot.done.set()
            if after is not None:
                after.done.set()
