"""Group commit (ptcproject/batching.py): a lone call runs at once on its own thread; concurrent
calls are done in batches by one of their callers; a batch's failure reaches each of its callers."""

import threading
import time
from typing import Any

import pytest

from ptcproject.batching import GroupCommit


def _release_when_waiting(
    batcher: GroupCommit[Any, Any], count: int, gate: threading.Event, threads: list[threading.Thread]
) -> None:
    """Open ``gate`` once ``count`` callers wait behind the running batch, then join ``threads``."""
    deadline = time.monotonic() + 5
    while len(batcher._waiting) < count and time.monotonic() < deadline:
        time.sleep(0.005)
    gate.set()
    for thread in threads:
        thread.join(5)


def test_a_lone_call_runs_at_once_on_the_callers_thread() -> None:
    seen: list[tuple[list[int], str]] = []

    def run(items: list[int]) -> list[int]:
        seen.append((items, threading.current_thread().name))
        return [item * 2 for item in items]

    double = GroupCommit(run)
    assert double(21) == 42
    assert double(5) == 10
    assert seen == [([21], threading.current_thread().name), ([5], threading.current_thread().name)]


def test_calls_that_arrive_while_a_batch_runs_go_together_in_the_next() -> None:
    batches: list[list[int]] = []
    first_running = threading.Event()
    release = threading.Event()

    def run(items: list[int]) -> list[str]:
        batches.append(items)
        if items == [0]:
            first_running.set()
            release.wait(5)  # the first batch holds while the others arrive
        return [f"done {item}" for item in items]

    batcher = GroupCommit(run)
    results: dict[int, str] = {}

    def call(item: int) -> None:
        results[item] = batcher(item)

    first = threading.Thread(target=call, args=(0,))
    first.start()
    assert first_running.wait(5)
    others = [threading.Thread(target=call, args=(i,)) for i in range(1, 31)]
    for thread in others:
        thread.start()
    _release_when_waiting(batcher, 30, release, [first, *others])
    assert results == {i: f"done {i}" for i in range(31)}
    assert batches[0] == [0]
    assert sorted(batches[1]) == list(range(1, 31)), "the 30 that waited went out in one batch"
    assert len(batches) == 2


def test_batches_are_capped_and_the_lead_passes_on() -> None:
    batches: list[list[int]] = []
    gate = threading.Event()

    def run(items: list[int]) -> list[int]:
        batches.append(items)
        gate.wait(5)
        return items

    batcher = GroupCommit(run, most=4)
    threads = [threading.Thread(target=batcher, args=(i,)) for i in range(10)]
    for thread in threads:
        thread.start()
    _release_when_waiting(batcher, 9, gate, threads)
    assert sorted(i for batch in batches for i in batch) == list(range(10)), "every item ran once"
    assert all(len(batch) <= 4 for batch in batches)
    assert not batcher._busy and not batcher._waiting, "nothing is left waiting, nobody leads"


def test_a_failed_batch_fails_each_of_its_callers_and_the_next_batch_still_runs() -> None:
    def run(items: list[int]) -> list[int]:
        if -1 in items:
            raise ValueError("the database said no")
        return items

    batcher = GroupCommit(run)
    with pytest.raises(ValueError, match="the database said no"):
        batcher(-1)
    assert batcher(3) == 3


def test_a_batch_that_returns_too_few_results_is_an_error_not_a_wrong_answer() -> None:
    batcher = GroupCommit(lambda items: items[:-1])
    with pytest.raises(RuntimeError, match="a batch of 1 gave 0 results"):
        batcher(1)
