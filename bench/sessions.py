"""A session's second call: the job handed to the session's sandbox (already running, its SDK
imported, its globals there) → the first line the code prints, beside a unix socketpair round trip
to another process, measured in the same run. Target: at most 2x that round trip + 1 ms (no spawn).

Also: the whole second job through the worker's bridge loop (``Session.run``: start frame, output,
done frame, outcome), for what the worker's side adds.

Needs no stack: ``python bench/sessions.py`` (Django settings for the sandbox's paths only).
"""

import os
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

from harness import print_table, row, sandbox_limits

ECHO = "import socket, sys\ns = socket.socket(fileno=int(sys.argv[1]))\nwhile d := s.recv(65536):\n    s.sendall(d)\n"


def _start(code: str) -> dict[str, Any]:
    return {
        "op": "start",
        "code": code,
        "limits": sandbox_limits().guest(),
        "max_frame": 1 << 20,
        "max_depth": 100,
        "job": {},
        "session": True,
        # As the worker sends every job: no input files, and the files the code wrote asked back.
        "files": {},
        "collect_files": {"max_bytes": 8 << 20, "max_count": 100},
    }


def second_call(runs: int) -> list[float]:
    """Start frame sent to a session's sandbox → its first printed line, ms, for calls 2..runs+1."""
    from execution.sandbox.pool import sandbox_start
    from tools.sdk_runtime.protocol import FrameDecoder, encode

    sandbox = sandbox_start()
    decoder = FrameDecoder(1 << 20)

    def done() -> None:
        while not decoder.feed(sandbox.bridge.recv(65536)):
            pass

    try:
        sandbox.bridge.sendall(encode({**_start("import json\nx = 1"), "sdk": []}))
        done()
        frame = encode(_start("print(x)"))
        samples = []
        for _ in range(runs):
            start = time.perf_counter()
            sandbox.bridge.sendall(frame)
            sandbox.proc.stdout.readline()  # type: ignore[union-attr]
            samples.append((time.perf_counter() - start) * 1000)
            done()
        return samples
    finally:
        sandbox.discard()


def socketpair_round_trip(runs: int, size: int) -> list[float]:
    """A ``size``-byte message to another process over a unix socketpair and back, ms."""
    ours, theirs = socket.socketpair()
    echo = subprocess.Popen([sys.executable, "-I", "-S", "-c", ECHO, str(theirs.fileno())], pass_fds=(theirs.fileno(),))
    theirs.close()
    message = b"x" * size
    samples = []
    try:
        for _ in range(runs + 20):  # the first ones warm the echo process up
            start = time.perf_counter()
            ours.sendall(message)
            got = 0
            while got < size:
                got += len(ours.recv(65536))
            samples.append((time.perf_counter() - start) * 1000)
    finally:
        ours.close()
        echo.wait()
    return samples[20:]


class _Quiet:
    """No tool results and no cancel: the channel of a job that calls no tool."""

    def __init__(self) -> None:
        self.r, self.w = os.pipe()

    def fileno(self) -> int:
        return self.r

    def drain(self) -> list[Any]:
        return []


def second_job_through_the_loop(runs: int) -> list[float]:
    """``Session.run`` of a session's second job (``print(x)``), start → outcome, ms."""
    from execution.sandbox.pool import sandbox_start
    from execution.sandbox.session import Session

    sandbox = sandbox_start()
    channel = _Quiet()
    limits = sandbox_limits()

    def run(code: str, sdk: dict[str, str] | None = None) -> Any:
        session = Session(
            code=code,
            limits=limits,
            sdk_files=sdk or {},
            router=None,  # type: ignore[arg-type]  # no call is made
            channel=channel,
            heartbeat=lambda: True,
            heartbeat_every=10,
            max_frame=1 << 20,
            max_buffered=1 << 20,
            sandbox=sandbox,
            keep=True,
            extra={"session": True, "files": {}, "collect_files": {"max_bytes": 8 << 20, "max_count": 100}},
        )
        outcome = session.run()
        assert session.kept and outcome.status == "completed", outcome
        return outcome

    try:
        run("x = 1")
        samples = []
        for _ in range(runs):
            start = time.perf_counter()
            run("print(x)")
            samples.append((time.perf_counter() - start) * 1000)
        return samples
    finally:
        sandbox.discard()


def main() -> None:
    import django

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "ptcproject.settings")
    django.setup()
    from tools.sdk_runtime.protocol import encode

    second = second_call(200)
    round_trip = socketpair_round_trip(200, len(encode(_start("print(x)"))))
    loop = second_job_through_the_loop(100)
    bound = [2 * ms + 1 for ms in round_trip]
    met = statistics.median(second) <= statistics.median(bound)
    print_table(
        "Sessions (2 cores): a second call in a session, no spawn",
        [
            row(
                "second call: start frame → first user line",
                second,
                "ms",
                round_trip,
                "≤ 2x + 1 ms" + ("" if met else " — **missed**"),
            ),
            row("  baseline: socketpair round trip to a process", round_trip, "ms"),
            row("  bound: 2x the round trip + 1 ms", bound, "ms"),
            row("second job through the worker's loop, start → outcome", loop, "ms", round_trip),
        ],
    )


if __name__ == "__main__":
    main()
