"""Work a worker process does on its own clock, beside its tasks: leases and the reaper."""

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from django.db import DatabaseError, connection

logger = logging.getLogger("ptc.periodic")


def run_every(name: str, seconds: float, work: Callable[[], Any], *, now: bool = False) -> threading.Thread:
    """Run ``work`` every ``seconds`` (and at once with ``now``) on a daemon thread, for the life of
    the process. A failure is logged and the loop goes on; the thread's database connection goes
    back to the pool after each round."""

    def loop() -> None:
        if not now:
            time.sleep(seconds)
        while True:
            try:
                work()
            except Exception:  # an outage or a bug must not stop the loop
                logger.warning("%s failed; trying again in %s s", name, seconds, exc_info=True)
            finally:
                try:
                    connection.close()
                except DatabaseError:
                    pass
            time.sleep(seconds)

    thread = threading.Thread(target=loop, name=name, daemon=True)
    thread.start()
    return thread
