"""Warm sandboxes: forked before their job, each used for one job only, then killed.

A sandbox's start (a fork of the fork server, its namespaces, its mounts) is about 1.5 ms; a job
should not wait even for that. Each exec worker keeps ``PTC_SANDBOX_POOL_SIZE`` sandboxes started
and waiting for their job (``guest.py`` blocks on the bridge's first frame before anything of a job
is in it: no code, no SDK, no limits). A job takes one and the pool's thread starts another in the
background: once the job is done with it (its sandbox discarded, after its end was announced), or
``REFILL_AFTER_SECONDS`` after it was taken, whichever comes first. A short job's end is not kept
waiting by the CPU of the next sandbox's start, on a machine of few cores. Nothing passes between
jobs: a sandbox is never given a second job, and one that was not taken is killed with its worker.
"""

import functools
import itertools
import logging
import queue
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from execution.sandbox import cgroups, process

logger = logging.getLogger("ptc.sandbox")
# After a failed start (a host that can't run sandboxes), wait this long before the next try.
RETRY_SECONDS = 5.0
# A taken sandbox's place in the pool is filled when its job is done with it, or this long after it
# was taken: a long job (or a session's, which keeps its sandbox) does not leave the pool short.
REFILL_AFTER_SECONDS = 0.25


@dataclass
class Sandbox:
    """A started sandbox waiting for its job on ``bridge``, the worker's end of its socketpair."""

    proc: process.SandboxProcess
    bridge: socket.socket
    warm: bool
    # Its processes' memory cgroup, limited when its job starts (None: rlimits alone hold them).
    memory: cgroups.MemoryGroup | None = None
    # Called once it is discarded: the pool it came from fills its place.
    on_discard: Callable[[], None] | None = None

    def discard(self) -> None:
        """Kill a sandbox and close what the worker holds of it."""
        try:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
            self.bridge.close()
            for pipe in (self.proc.stdout, self.proc.stderr):
                if pipe:
                    pipe.close()
            if self.memory is not None:
                self.memory.remove()
        finally:
            done, self.on_discard = self.on_discard, None
            if done is not None:
                done()


_reaped: "queue.SimpleQueue[Sandbox]" = queue.SimpleQueue()
_reaper_lock = threading.Lock()
_reaper: threading.Thread | None = None


def sandbox_reap(sandbox: Sandbox) -> None:
    """Kill a used sandbox now and leave its reaping (the wait for bubblewrap's exit, closing what
    the worker holds of it) to this process's reaper thread."""
    global _reaper
    if sandbox.proc.poll() is None:
        sandbox.proc.kill()
    _reaped.put(sandbox)
    with _reaper_lock:
        if _reaper is None:
            _reaper = threading.Thread(target=_reap_forever, name="ptc-sandbox-reaper", daemon=True)
            _reaper.start()


def _reap_forever() -> None:
    while True:
        sandbox = _reaped.get()
        try:
            sandbox.discard()
        except Exception:  # one sandbox's cleanup must not stop the others'
            logger.exception("could not reap a sandbox")


def sandbox_start() -> Sandbox:
    """Start one sandbox now. Raise process.SandboxUnavailable when this host can't."""
    ours, theirs = socket.socketpair()
    try:
        proc = process.spawn(bridge_fd=theirs.fileno())
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    return Sandbox(proc=proc, bridge=ours, warm=False, memory=cgroups.memory_group(proc.pid))


class WarmPool:
    """Keeps ``size`` started sandboxes ready; ``take`` hands one out, or starts one if none is."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._ready: deque[Sandbox] = deque()
        # Sandboxes taken whose places are not to be filled yet: when each one's is filled anyway.
        self._lent: dict[int, float] = {}
        self._lending = itertools.count()
        self._wanted = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the thread that fills the pool. Idempotent; a size of 0 starts nothing."""
        with self._wanted:
            if self._thread is not None or self.size <= 0 or self._closed:
                return
            self._thread = threading.Thread(target=self._fill, name="ptc-sandbox-pool", daemon=True)
            self._thread.start()

    def take(self) -> Sandbox:
        """Return a sandbox for one job: a warm one if the pool has one alive, else a new one."""
        with self._wanted:
            while self._ready:
                sandbox = self._ready.popleft()
                if sandbox.proc.poll() is None:
                    lent = next(self._lending)
                    self._lent[lent] = time.monotonic() + REFILL_AFTER_SECONDS
                    sandbox.on_discard = functools.partial(self._returned, lent)
                    self._wanted.notify()  # to wait for the time its place is filled at the latest
                    return sandbox
                said = sandbox.proc.stderr.read1(1024).decode(errors="replace").strip()
                logger.warning("a warm sandbox had exited (status %s); discarded: %s", sandbox.proc.returncode, said)
                sandbox.discard()
        return sandbox_start()

    def ready(self) -> int:
        """How many warm sandboxes wait for a job now."""
        with self._wanted:
            return len(self._ready)

    def close(self) -> None:
        """Kill every warm sandbox; ``take`` starts a new one each time from now on."""
        with self._wanted:
            self._closed = True
            ready, self._ready = list(self._ready), deque()
            self._wanted.notify_all()
        for sandbox in ready:
            sandbox.discard()

    def _returned(self, lent: int) -> None:
        with self._wanted:
            if self._lent.pop(lent, None) is not None:
                self._wanted.notify()

    def _short(self) -> float | None:
        """0 if a sandbox is to be started now, else how long until one is (None: until told)."""
        now = time.monotonic()
        self._lent = {lent: due for lent, due in self._lent.items() if due > now}
        if len(self._ready) + len(self._lent) < self.size:
            return 0
        return min(self._lent.values()) - now if self._lent else None

    def _fill(self) -> None:
        while True:
            with self._wanted:
                while not self._closed and (wait := self._short()) != 0:
                    self._wanted.wait(wait)
                if self._closed:
                    return
            try:
                sandbox = sandbox_start()
            except Exception as exc:  # the worker's start-up check has said why; a job's error will too
                logger.warning("could not start a warm sandbox: %s", exc)
                time.sleep(RETRY_SECONDS)
                continue
            sandbox.warm = True
            with self._wanted:
                if self._closed:
                    keep = False
                else:
                    self._ready.append(sandbox)
                    keep = True
            if not keep:
                sandbox.discard()


_pool: WarmPool | None = None
_pool_lock = threading.Lock()


def warm_pool() -> WarmPool:
    """This process's pool, sized by ``PTC_SANDBOX_POOL_SIZE``. Exec workers start it when ready;
    until then (or elsewhere) ``take`` starts each sandbox when it is needed."""
    global _pool
    from django.conf import settings

    with _pool_lock:
        if _pool is None:
            _pool = WarmPool(settings.PTC_SANDBOX_POOL_SIZE)
        return _pool
