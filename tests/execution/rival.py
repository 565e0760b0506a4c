"""A rival answer to a waiting call: its UPDATE made and not yet committed, so that the answer a
test sends meanwhile waits on the call's row, as one of two answers sent at once does."""

import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import httpx
from django.db import connection, transaction


@contextmanager
def rival_answer(call_id: str, **fields: Any) -> Iterator[Callable[[Callable[[], httpx.Response]], Future[httpx.Response]]]:
    """Write ``fields`` on the call ``call_id`` in a transaction left open: the row stays locked.
    Yield ``send``, which starts a request in a thread and returns once PostgreSQL has it waiting
    for that lock (its future gives the response). The rival commits as the block ends."""
    from execution.models import ToolCall

    with ThreadPoolExecutor(1) as pool, transaction.atomic():
        assert ToolCall.objects.filter(call_id=call_id).update(**fields) == 1

        def send(request: Callable[[], httpx.Response]) -> Future[httpx.Response]:
            future = pool.submit(request)
            deadline = time.monotonic() + 15
            while not _a_statement_waits_for_a_lock():
                assert not future.done(), f"the request did not wait for the call's row: {future.result().text}"
                assert time.monotonic() < deadline, "no statement came to wait for the call's row"
                time.sleep(0.02)
            return future

        yield send


def _a_statement_waits_for_a_lock() -> bool:
    """Whether another session waits for a lock this one holds. ``pg_stat_activity`` is read once a
    transaction unless its snapshot is cleared; ``pg_blocking_pids`` reads the locks as they are."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_clear_snapshot()")
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE pg_backend_pid() = ANY(pg_blocking_pids(pid))")
        return bool(cursor.fetchone()[0])
