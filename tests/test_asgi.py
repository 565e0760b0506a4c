"""The web's ASGI handler: each request on a kept thread of its own, requests side by side."""

import threading
import time

from ptcproject.asgi import _Threads
from tests.conftest import Api


def test_request_threads_are_kept_for_the_next_requests_up_to_a_bound() -> None:
    threads = _Threads(idle=1)
    first = threads.take()
    assert threads.take() is not first  # one request at a time on each
    threads.give(first)
    assert threads.take() is first
    second = threads.take()
    threads.give(first)
    threads.give(second)  # past the bound: let go
    assert second._shutdown and not first._shutdown
    assert threads.take() is first
    first.shutdown()


def test_a_request_that_waits_holds_no_other(api: Api) -> None:
    # A submit that waits for its job's end blocks its own thread only: reads answer meanwhile.
    ended: list[float] = []

    def submit() -> None:
        assert api.run("import time\ntime.sleep(2)")["status"] == "completed"
        ended.append(time.monotonic())

    waiting = threading.Thread(target=submit)
    waiting.start()
    time.sleep(0.3)  # it is waiting
    answered = []
    for _ in range(20):
        assert api.get("/api/v1/exec").status_code == 200
        answered.append(time.monotonic())
    waiting.join()
    assert ended and max(answered) < ended[0]
