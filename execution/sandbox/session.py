"""One job's life in its sandbox: the worker side of the bridge.

A single thread multiplexes the sandbox's bridge socket, its stdout and stderr pipes, and the
job's channel (tool results pushed by tools workers, and cancel), with ``selectors``. Nothing on
this path polls: every wake-up is a frame, a chunk of output, a pushed message or a deadline.
"""

import codecs
import contextlib
import fcntl
import importlib.util
import io
import logging
import marshal
import os
import queue
import selectors
import signal
import socket
import subprocess
import sys
import termios
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from execution.backplane import (
    Admitted,
    Answer,
    Approved,
    Ask,
    Cancel,
    Message,
    Released,
    Result,
    Resync,
    backplane,
    call_channel,
)
from execution.sandbox.limits import CALL_GRACE_SECONDS, Limits
from execution.sandbox.output import LIVE_CUT, CappedOutput
from execution.sandbox.pool import Sandbox, sandbox_reap, warm_pool
from execution.sandbox.process import MOUNT_SDK, SandboxProcess, scratch_bytes
from ptcproject.errors import call_error, job_error
from ptcproject.kept import Kept
from ptcproject.storage import MAX_JSON_DEPTH
from tools.sdk_runtime.protocol import FrameDecoder, FrameError, encode, pack

logger = logging.getLogger("ptc.sandbox")
# A session's sandbox is given this long to take what its job's end sends it (_hand_back).
HAND_BACK_SECONDS = 2.0
# A sandbox whose streams all closed before its result is given this long to exit by itself.
EXIT_GRACE_SECONDS = 2.0
# Calls waiting for a free slot, at most; past that the bridge stops reading and the code's next
# call blocks in its own send(), so a flood of calls costs the worker nothing.
MAX_WAITING_CALLS = 64
# Calls are checked, recorded and enqueued on a few threads, so a burst of calls doesn't queue
# behind one thread's database round trips.
SUBMIT_THREADS = 4
# Results that arrive before their call's submission has been seen (a fast tool), kept at most.
MAX_EARLY_RESULTS = 1024
# A job's code asks for its key once (its runtime keeps it); past this many asks the bridge is abused.
MAX_KEY_ASKS = 16
# The runtime asks for each SDK file once, when first used; past this many asks the bridge is abused.
MAX_SDK_ASKS = 256
# Output goes out as events in chunks: every 50 ms or 4 KB, whichever comes first.
OUTPUT_CHUNK_SECONDS = 0.05
OUTPUT_CHUNK_BYTES = 4096
OUTPUT = ("stdout", "stderr")


@dataclass
class Outcome:
    status: str  # completed | failed | timeout | cancelled
    return_value: Any = None
    error: dict[str, Any] | None = None
    stdout: str = ""
    stderr: str = ""
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    timings: dict[str, float] = field(default_factory=dict)
    # What the done frame said of /work (when the job asked): files the code wrote, as
    # ``{"path", "data" (base64)}``; paths left out over the quota; paths it removed.
    files: list[dict[str, str]] = field(default_factory=list)
    files_omitted: list[str] = field(default_factory=list)
    files_removed: list[str] = field(default_factory=list)
    # Whether the code asked for its job-scoped key (made then): a job that never did has none.
    key_made: bool = False
    # The output not yet passed on when the job ended, ``(stream, text)``: it goes out with the
    # job's end, in the same round trip (Session's ``on_output`` had the rest).
    tail: list[tuple[str, str]] = field(default_factory=list)
    # The sandbox that gave the result, still alive, for the caller to reap (sandbox_reap) once
    # the job's end is announced: its teardown, and the warm one that takes its place, come after.
    spent: Sandbox | None = None


@dataclass(frozen=True)
class Dispatched:
    call_id: str
    timeout: float
    # "client" or "approval" when the call waits on the job's caller or an approver, not a worker.
    awaiting: str = ""


@dataclass(frozen=True)
class Refused:
    call_id: str
    error: dict[str, str]


@dataclass(frozen=True)
class Looked:
    """What a call's record says after the channel reconnected: its reply if it has finished, and
    if it was approved, its ``Approved`` and how many seconds ago (its job's clock ran since)."""

    reply: dict[str, Any] | None = None
    approved: Approved | None = None
    approved_ago: float = 0.0


@dataclass(frozen=True)
class Granted:
    """The tool of a job's grant a call over HTTP names: its id, and its timeout."""

    tool_id: str
    timeout: float


class CallRouter(Protocol):
    """What the session needs from the rest of the system to run a tool call."""

    def submit_many(self, requests: list[tuple[str, str, Any]]) -> list[Dispatched | Refused]:
        """Check, record and enqueue calls ``(toolset, tool, arguments)``; return each one's outcome,
        in order. Called on the session's submit threads."""
        ...

    def lookup(self, *, call_id: str) -> Looked:
        """From its record: a finished call's reply, and whether (and when) it was approved."""
        ...

    def overdue(self, *, call_id: str) -> dict[str, Any] | float:
        """Return the reply for a call whose result never arrived (from its record, or a failure);
        or, while its record says its tools worker may still run it, how many seconds more it may."""
        ...

    def closed(self, *, open_calls: list[str]) -> None:
        """The job ended with these calls unanswered (their code will never read a reply)."""
        ...

    def calls_open(self, *, call_ids: list[str]) -> dict[str, bool] | None:
        """Of these calls (the job's over HTTP), whether each recorded one is still open, by call id;
        one with no record is left out. None if the records can't be read now."""
        ...

    def calls_fence(self, *, epoch: int) -> bool:
        """Raise the job's ``http_admit_epoch`` to ``epoch``: no call over HTTP admitted under an
        earlier one is recorded from now on (one being recorded is, first). False if it can't be now."""
        ...

    def granted(self, *, toolset: str, tool: str) -> "Granted | dict[str, str]":
        """The tool ``toolset.tool`` of the job's grant, as it started (its code's calls are checked
        against the same), for a call over HTTP with its key; or why it is none (``call_error``)."""
        ...


class Subscription(Protocol):
    def fileno(self) -> int: ...

    def drain(self) -> list[Message]: ...


@dataclass
class _InFlight:
    request_id: int
    deadline: float


# What the sandbox is sent of the SDK files asked for lately, keyed by their text (the same objects
# job after job, from the SDK's cache: hashed once). GitHub's module is 179 KB of source, 10 ms to
# compile, and with its bytecode 480 KB of frame; packed, 130 KB.
MAGIC = importlib.util.MAGIC_NUMBER.hex()
_PACKED: Kept[tuple[str, str, bool], dict[str, str | None]] = Kept(32)


def sdk_file_packed(name: str, text: str, *, compiled: bool) -> dict[str, str | None]:
    """Return the SDK file ``name`` (``text``) as the sandbox is sent it: ``text`` packed
    (protocol.pack), and with ``compiled`` (a module, for an interpreter that reads this one's
    bytecode) its ``code`` compiled and marshalled, packed too; None if it can't be (the
    sandbox compiles it then, and says why)."""
    packed = _PACKED.get((name, text, compiled))
    if packed is None:
        code = None
        if compiled:
            try:
                code = pack(marshal.dumps(compile(text, f"{MOUNT_SDK}/{name}", "exec", dont_inherit=True, optimize=0)))
            except Exception:  # its import says why, in the sandbox
                code = None
        packed = {"text": pack(text.encode()), "code": code}
        _PACKED.put((name, text, compiled), packed)
    return packed


def _key_call_deadline(now: float, timeout: float) -> float:
    """When a call over HTTP with the job's key, of a tool of ``timeout``, gives back its slot if
    its Released never comes: past its caller's own bound on it (the tool's timeout and the grace),
    with as much again for the rest of its request (a caller that died says nothing)."""
    return now + timeout + 2 * CALL_GRACE_SECONDS


def _shown(value: Any) -> str:
    """What the sandbox sent, as an error message quotes it: at most 80 characters of it."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."


class Session:
    def __init__(
        self,
        *,
        code: str,
        limits: Limits,
        sdk_files: dict[str, str],
        router: CallRouter,
        sdk_new: bool = True,
        channel: Subscription,
        heartbeat: Callable[[], bool],
        heartbeat_every: float,
        max_frame: int,
        max_buffered: int,
        job_info: dict[str, Any] | None = None,
        on_output: Callable[[str, str], None] | None = None,
        sandbox: Sandbox | None = None,
        keep: bool = False,
        extra: dict[str, Any] | None = None,
        max_files_bytes: int = 0,
        make_key: Callable[[], str] | None = None,
        max_tool_bytes: int = 0,
    ) -> None:
        self.code = code
        self.limits = limits
        # The job's SDK files, given to the sandbox one by one as it asks (``op: sdk``). A session's
        # sandbox that has this SDK from an earlier job (not ``sdk_new``) is not told their names again.
        self.sdk_files = sdk_files
        self.sdk_new = sdk_new
        self.sdk_sent: set[str] = set()
        self.sdk_asks = 0
        self.router = router
        self.channel = channel
        self.heartbeat = heartbeat
        self.heartbeat_every = heartbeat_every
        # A done frame may carry files (base64) besides its value: others are held to max_frame, as
        # the sandbox's runtime holds them (a frame written by hand is checked here).
        self.decoder = FrameDecoder(max_frame + (max_files_bytes * 4 // 3 + (64 << 10) if max_files_bytes else 0))
        # A session's sandbox (``sandbox``, ``keep``): given, not taken from the pool, and left
        # running after a job that ended with its result, or that ended before anything of it
        # was sent (cancelled as it started); ``kept`` says whether it was.
        self.sandbox = sandbox
        self.keep = keep
        self.kept = False
        self.sent_any = False  # whether any of the job reached the sandbox
        # More of the start frame: a session's flag, input files, the files quota.
        self.extra = extra or {}
        self.max_frame = max_frame
        self.max_buffered = max_buffered
        self.job_info = job_info or {}
        # The job's key, made by ``make_key`` when the code first asks for it (``op: key``).
        self.make_key = make_key
        self.key: str | None = None
        self.key_error: dict[str, str] | None = None
        self.key_asked = False
        self.key_asks = 0
        self.on_output = on_output
        # Output is passed on in chunks of at most OUTPUT_CHUNK_BYTES or OUTPUT_CHUNK_SECONDS old.
        self.chunks: dict[str, bytearray] = {"stdout": bytearray(), "stderr": bytearray()}
        self.chunk_since: dict[str, float] = {}
        self.streamed: dict[str, int] = {}
        self.tail: list[tuple[str, str]] = []  # the last chunks, held for the job's end (Outcome.tail)
        self.decoders = {name: codecs.getincrementaldecoder("utf-8")("replace") for name in self.chunks}
        self.stdout = CappedOutput(limits.max_output_bytes)
        self.stderr = CappedOutput(limits.max_output_bytes)
        self.outbox = bytearray()
        self.in_flight: dict[str, _InFlight] = {}
        self.submitting = 0
        self.to_submit: list[tuple[int, str, str, Any]] = []
        # Calls handed to the submit threads and not yet taken by one, and how many threads run.
        self.submit_lock = threading.Lock()
        self.unsubmitted: list[tuple[int, str, str, Any]] = []
        self.submitters = 0
        self.submit_stopped = False
        self.submitted: queue.SimpleQueue[tuple[int, Dispatched | Refused | None]] = queue.SimpleQueue()
        self.early: dict[str, dict[str, Any]] = {}
        self.waiting: deque[dict[str, Any]] = deque()
        self.calls = 0
        # The job's calls made over HTTP with its key, which count against its limit too: this bridge
        # admits them (``Ask``), so that the two ways together never pass its limit or its parallel
        # cap. Those in flight hold a slot of the cap until their ``Released``, or their deadline
        # (a web process that died with one never says), by call id.
        self.key_calls = 0
        self.key_in_flight: dict[str, float] = {}
        self.key_admitted: dict[str, float] = {}  # when each of those was admitted
        self.key_epoch = 0  # the job's http_admit_epoch: what those are admitted under (calls_fence)
        self.stopped = False  # the loop has stopped: the job is ending, and admits no call
        # The bytes of its calls' frames and of their answers so far, and the most it may pass
        # (0: no bound). Each call is recorded whole, and every view of the job (exec_end, GET, MCP)
        # carries every call's arguments and result: past this, the job ends, rather than make
        # views of gigabytes.
        self.tool_bytes = 0
        self.http_tool_bytes = 0  # what its calls over HTTP with its key passed, as its last Admitted said
        self.max_tool_bytes = max_tool_bytes
        # Calls waiting on the client or an approval. While any does, the job's clock is stopped,
        # up to limits.max_client_wait in all: ``waited`` is what was credited so far.
        self.awaiting: set[str] = set()
        self.awaiting_since: float | None = None
        self.waited = 0.0
        self.result: dict[str, Any] | None = None
        self.ended: Outcome | None = None  # set when the worker ends the job (timeout, cancel, limit)
        self.out_of_memory = False  # whether the kernel killed one of its processes for its memory cgroup's limit
        self.oom_kills = 0  # how many its sandbox's memory cgroup had seen when the job started
        self.foreign_results = 0  # result frames of the session's earlier jobs, dropped

    # -- the loop --------------------------------------------------------------------------------
    def run(self) -> Outcome:
        started = time.monotonic()
        sandbox = self.sandbox or warm_pool().take()
        proc, ours = sandbox.proc, sandbox.bridge
        if sandbox.memory is not None:  # its processes together: its memory, and what its scratch holds
            # A session's sandbox counts its kills for its whole life; a new one has none.
            self.oom_kills = sandbox.memory.oom_kills() if self.keep else 0
            try:
                sandbox.memory.limit(self._guest_limits()["memory_bytes"] + scratch_bytes())
            except OSError as exc:  # its rlimits still hold each process
                logger.warning("could not limit a sandbox's memory cgroup: %s", exc)
        spawned = time.monotonic()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self.submitter = ThreadPoolExecutor(SUBMIT_THREADS, thread_name_prefix="ptc-submit")
        looped = False
        try:
            self._loop(proc, ours, base_deadline=spawned + self.limits.timeout)
            looped = True
        finally:
            # Submissions not started are dropped (never recorded); started ones finish first.
            with self.submit_lock:
                self.submit_stopped = True
            self.submitter.shutdown(wait=True, cancel_futures=True)
            unanswered = self._close_calls()
            # Calls over HTTP asking as the job ends are told so now, not left to find out by its record.
            self.stopped = True
            for message in self.channel.drain():
                if isinstance(message, Ask):
                    self._ask(message)
            os.close(self._wake_r)
            os.close(self._wake_w)
            ended_well = self.ended is None and self.result is not None
            self.kept = self.keep and (ended_well or not self.sent_any) and proc.poll() is None
            # Kept with nothing of the job sent (cancelled as it started): its start frame is not sent now.
            if self.kept and self.sent_any and not self._hand_back(ours, unanswered):
                self.kept = False
                proc.send_signal(signal.SIGKILL)
            returncode = 0
            spent = None
            if not self.kept and self.result is not None:
                # The job has its result: its sandbox waits to be killed (outcome.spent) until its
                # end is out (the teardown of its namespaces is milliseconds the client needn't
                # wait). A run that fails instead has no end to wait for: it is killed now.
                if looped:
                    spent = sandbox
                else:
                    sandbox_reap(sandbox)
            elif not self.kept:
                self.out_of_memory = sandbox.memory is not None and sandbox.memory.oom_kills() > self.oom_kills
                if self.ended is None:
                    # Its streams closed by themselves: it is exiting, and its status (which the
                    # fork server reports a moment later) says how. Killed, it would say nothing.
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(EXIT_GRACE_SECONDS)
                sandbox.discard()
                returncode = proc.wait()
        try:
            outcome = self.ended or self._outcome(returncode)
        except BaseException:
            if spent is not None:
                sandbox_reap(spent)
            raise
        outcome.spent = spent
        outcome.key_made = self.key_asked
        outcome.tail = self.tail
        outcome.stdout, outcome.stdout_truncated = self.stdout.text(), self.stdout.truncated
        outcome.stderr, outcome.stderr_truncated = self.stderr.text(), self.stderr.truncated
        finished = time.monotonic()
        outcome.timings = {
            "spawn_ms": round((spawned - started) * 1000, 2),
            "warm": sandbox.warm,
            "run_ms": round((finished - spawned) * 1000, 2),
            "tool_calls": self.calls,
            "client_wait_ms": round(self._client_wait(finished) * 1000, 2),
        }
        return outcome

    def _close_calls(self) -> list[int]:
        """Tell the router which calls the job left unanswered: in flight, or submitted after the loop
        stopped reading. A failure here is logged: the job's end is recorded regardless. Return the
        request ids of every call of the sandbox left without an answer (those, and the ones never
        submitted)."""
        open_calls = list(self.in_flight)
        unanswered = [call.request_id for call in self.in_flight.values()]
        unanswered += [request_id for request_id, *_ in self.to_submit + self.unsubmitted]
        unanswered += [message["id"] for message in self.waiting]
        while True:
            try:
                request_id, submitted = self.submitted.get_nowait()
            except queue.Empty:
                break
            unanswered.append(request_id)
            if isinstance(submitted, Dispatched):
                open_calls.append(submitted.call_id)
        if open_calls:
            try:
                self.router.closed(open_calls=open_calls)
            except Exception:
                logger.exception("could not close the calls a job left open")
        return unanswered

    def _hand_back(self, sock: socket.socket, unanswered: list[int]) -> bool:
        """Before a session's sandbox waits for its next job: answer every call the job left open
        (a thread of its code still waits on each) and send what is still to send (the replies to
        frames read with the result: an SDK file a thread is importing holds the sandbox's import
        lock until it comes). Return False if the sandbox does not take it within HAND_BACK_SECONDS."""
        error = call_error("job_ended", "the job this call was made in has ended; no result comes back to it")
        for request_id in unanswered:
            self.outbox += encode({"id": request_id, "ok": False, "call_id": "", "error": error})
        deadline = time.monotonic() + HAND_BACK_SECONDS
        with selectors.DefaultSelector() as sel:
            sel.register(sock, selectors.EVENT_WRITE)
            while self.outbox:
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    logger.warning("a session's sandbox did not read its bridge at its job's end; not kept")
                    return False
                if not self._flush(sock):
                    return False
        return True

    def _client_wait(self, now: float) -> float:
        """Return the seconds of waiting on the client the job's clock does not count (so far)."""
        waiting = now - self.awaiting_since if self.awaiting_since is not None else 0.0
        return min(self.limits.max_client_wait, self.waited + waiting)

    def _set_awaiting(self, call_id: str, awaiting: bool, *, ago: float = 0.0) -> None:
        """Mark a call as waiting on the client (or an approval), or no longer (as of ``ago``
        seconds back): the job's clock stops while at least one call waits, and runs again when
        none does."""
        now = time.monotonic()
        if not awaiting and self.awaiting_since is not None:
            now = max(self.awaiting_since, now - ago)
        before = bool(self.awaiting)
        if awaiting:
            self.awaiting.add(call_id)
        else:
            self.awaiting.discard(call_id)
        if not before and self.awaiting:
            self.awaiting_since = now
        elif before and not self.awaiting and self.awaiting_since is not None:
            self.waited += now - self.awaiting_since
            self.awaiting_since = None

    def _loop(self, proc: SandboxProcess, sock: socket.socket, *, base_deadline: float) -> None:
        sock.setblocking(False)
        start = {
            "op": "start",
            "code": self.code,
            "limits": self.limits.guest(),
            "max_frame": self.max_frame,
            "max_depth": MAX_JSON_DEPTH,
            "job": self.job_info,
            "sdk": sorted(self.sdk_files) if self.sdk_new else None,
            **self.extra,
        }
        self.outbox += encode(start)
        # A cancel pushed since the job was last checked ends it here, before its code is sent.
        for message in self.channel.drain():
            self._on_channel(message)
        sel = selectors.DefaultSelector()
        sel.register(sock, selectors.EVENT_READ | selectors.EVENT_WRITE, "bridge")
        sel.register(proc.stdout, selectors.EVENT_READ, "stdout")
        sel.register(proc.stderr, selectors.EVENT_READ, "stderr")
        sel.register(self.channel.fileno(), selectors.EVENT_READ, "channel")
        sel.register(self._wake_r, selectors.EVENT_READ, "submitted")
        open_streams = {"bridge", "stdout", "stderr"}
        paused_bridge = False
        next_beat = time.monotonic() + self.heartbeat_every
        try:
            # A job ends with its result: what the code printed before it is drained below; a kept
            # sandbox's streams stay open for the next job, any other sandbox is killed.
            while (open_streams or paused_bridge) and self.ended is None and self.result is None:
                now = time.monotonic()
                deadline = base_deadline + self._client_wait(now)
                flush_at = [t + OUTPUT_CHUNK_SECONDS for t in self.chunk_since.values()]
                wake = min(
                    [deadline, next_beat, *flush_at, *self.key_in_flight.values()] + [c.deadline for c in self.in_flight.values()]
                )
                # Output before the bridge: what the code printed before a call was written before
                # the call was sent, so when both are ready the output is read first, and its
                # events go out before the call's.
                ready = sorted(sel.select(max(0.0, wake - now)), key=lambda event: event[0].data not in OUTPUT)
                for key, mask in ready:
                    if key.data == "bridge":
                        if mask & selectors.EVENT_WRITE and self.outbox:
                            self._flush(sock)
                        if mask & selectors.EVENT_READ and not self._read_bridge(sock):
                            open_streams.discard("bridge")
                            sel.unregister(sock)
                            continue
                    elif key.data in ("stdout", "stderr"):
                        data = key.fileobj.read1(1 << 16)  # type: ignore[union-attr]
                        if data:
                            (self.stdout if key.data == "stdout" else self.stderr).feed(data)
                            self._chunk(key.data, data)
                        else:
                            open_streams.discard(key.data)
                            sel.unregister(key.fileobj)
                    elif key.data == "channel":
                        for message in self.channel.drain():
                            self._on_channel(message)
                        if self.channel.fileno() != key.fd:  # followed another way from now on (subscribe_direct)
                            sel.unregister(key.fd)
                            sel.register(self.channel.fileno(), selectors.EVENT_READ, "channel")
                    elif key.data == "submitted":
                        self._on_submitted()
                    if self.ended is not None:
                        break
                now = time.monotonic()
                deadline = base_deadline + self._client_wait(now)
                for name, since in list(self.chunk_since.items()):
                    if now >= since + OUTPUT_CHUNK_SECONDS:
                        self._flush_chunk(name)
                if now >= deadline and self.ended is None:
                    self._end("timeout", "Timeout", f"the code ran past its {self.limits.timeout:g} s timeout")
                if now >= next_beat:
                    if not self.heartbeat():  # the job was ended elsewhere: a cancel whose push was lost
                        self._end("cancelled", "Cancelled", "the job was ended while it ran")
                    next_beat = now + self.heartbeat_every
                    if self.key_admitted:
                        self._key_calls_check(settled_before=now - 2 * self.heartbeat_every)
                for call_id, call in list(self.in_flight.items()):
                    if now >= call.deadline and call_id in self.in_flight:
                        overdue = self.router.overdue(call_id=call_id)
                        if isinstance(overdue, dict):
                            self._reply(call_id, overdue)
                        else:
                            # Its deadline counted from its dispatch by its tool's timeout as the job
                            # started; its tools worker runs it from its claim by the timeout as it is
                            # (raised since), and its record says so: it is waited for by that.
                            call.deadline = time.monotonic() + overdue
                if self.key_in_flight and now >= min(self.key_in_flight.values()):
                    self._key_calls_release([c for c, at in self.key_in_flight.items() if now >= at])
                # Last: what this wake-up dispatched goes out in one go, and replies are written.
                self._flush_submits()
                if "bridge" in open_streams:
                    reading = selectors.EVENT_READ if len(self.waiting) < MAX_WAITING_CALLS else 0
                    events = reading | (selectors.EVENT_WRITE if self.outbox else 0)
                    if events:
                        sel.modify(sock, events, "bridge")
                    else:
                        sel.unregister(sock)
                        open_streams.discard("bridge")
                        paused_bridge = True
                elif paused_bridge and len(self.waiting) < MAX_WAITING_CALLS:
                    sel.register(sock, selectors.EVENT_READ | selectors.EVENT_WRITE, "bridge")
                    open_streams.add("bridge")
                    paused_bridge = False
            if self.result is not None and self.ended is None:
                self._drain_output(proc)
        finally:
            sel.close()
            for name in list(self.chunk_since):
                self._flush_chunk(name, final=True)
            if self.ended is not None and (self.sent_any or not self.keep):
                # Killing the sandbox kills its PID 1, and its PID namespace: every descendant goes too.
                proc.send_signal(signal.SIGKILL)

    # -- output --------------------------------------------------------------------------------
    def _drain_output(self, proc: SandboxProcess) -> None:
        """Read what the code printed before its result (written before the done frame was sent,
        so already in the pipes) without waiting for the streams to close: they stay open. What
        is in a pipe now, and no more: a thread of the code that goes on writing can't hold the
        job's end."""
        for name, pipe in (("stdout", proc.stdout), ("stderr", proc.stderr)):
            left = _pending(pipe) if pipe is not None and not pipe.closed else 0
            while left > 0 and pipe is not None:
                data = pipe.read1(left)
                if not data:
                    break
                left -= len(data)
                (self.stdout if name == "stdout" else self.stderr).feed(data)
                self._chunk(name, data)

    def _chunk(self, name: str, data: bytes) -> None:
        if self.on_output is None:
            return
        # Stream no more than the job keeps: past that, one marker, and exec_end has the tail.
        sent = self.streamed.get(name, 0)
        self.streamed[name] = sent + len(data)
        if sent >= self.limits.max_output_bytes:
            return
        if sent + len(data) >= self.limits.max_output_bytes:
            data = data[: self.limits.max_output_bytes - sent] + f"\n{LIVE_CUT}\n".encode()
        self.chunks[name] += data
        self.chunk_since.setdefault(name, time.monotonic())
        if len(self.chunks[name]) >= OUTPUT_CHUNK_BYTES:
            self._flush_chunk(name)

    def _flush_chunk(self, name: str, final: bool = False) -> None:
        """Pass on what ``name`` has gathered; the last of it (``final``) is held in ``tail``."""
        data, self.chunks[name] = bytes(self.chunks[name]), bytearray()
        self.chunk_since.pop(name, None)
        text = self.decoders[name].decode(data, final=final)
        if text and final:
            self.tail.append((name, text))
        elif text and self.on_output is not None:
            self.on_output(name, text)

    # -- the bridge ------------------------------------------------------------------------------
    def _flush(self, sock: socket.socket) -> bool:
        """Send what the socket takes now. Return False if the sandbox's end is closed."""
        try:
            sent = sock.send(self.outbox)
        except BlockingIOError:
            return True
        except OSError:
            self.outbox.clear()  # the sandbox is gone; its exit is reported when the pipes close
            return False
        del self.outbox[:sent]
        self.sent_any = self.sent_any or sent > 0
        return True

    def _read_bridge(self, sock: socket.socket) -> bool:
        """Read and handle frames. Return False when the sandbox closed its end."""
        try:
            data = sock.recv(1 << 16)
        except BlockingIOError:
            return True
        except OSError:
            return False
        if not data:
            return False
        try:
            messages = self.decoder.feed_sized(data)
        except FrameError as exc:
            self._end("failed", "BridgeError", f"the sandbox sent a malformed bridge frame: {exc}")
            return False
        for message, size in messages:
            self._on_frame(message, size)
            if self.ended is not None:
                return False
        return True

    def _on_frame(self, message: dict[str, Any], size: int) -> None:
        op = message.get("op")
        if op == "call" and isinstance(message.get("id"), int):
            # What the code printed before this call goes out before it: the events read in order.
            for name in list(self.chunk_since):
                self._flush_chunk(name)
            self.calls += 1
            self._count_tool_bytes(size)
            if self.ended is not None:  # past the bytes its calls may pass: this one is not sent
                pass
            elif self.calls + self.key_calls > self.limits.max_tool_calls:
                self._end("failed", "ResourceLimit", f"tool-call limit of {self.limits.max_tool_calls} per job reached")
            elif size > self.max_frame:  # the SDK refuses such arguments before they are sent
                error = call_error("invalid_arguments", f"the call is {size} bytes of JSON; the limit is {self.max_frame}")
                self._send({"id": message["id"], "ok": False, "error": error})
            elif self._busy() >= self.limits.max_parallel_tool_calls:
                self.waiting.append(message)  # waits for a free slot; it does not fail
            else:
                self._dispatch(message)
        elif op == "key" and isinstance(message.get("id"), int):
            self.key_asks += 1
            if self.key_asks > MAX_KEY_ASKS:
                self._end("failed", "BridgeError", f"the sandbox asked for its job's key over {MAX_KEY_ASKS} times")
            else:
                self._send({"id": message["id"], **self._job_key(message.get("call_id"))})
        elif op == "sdk" and isinstance(message.get("id"), int):
            self.sdk_asks += 1
            wanted = message.get("name")
            if self.sdk_asks > MAX_SDK_ASKS:
                self._end("failed", "BridgeError", f"the sandbox asked for its SDK's files over {MAX_SDK_ASKS} times")
            elif not isinstance(wanted, str) or wanted not in self.sdk_files or wanted in self.sdk_sent:
                # A thread an earlier job of the session left may ask for that job's files: an error
                # for it, not this job's end. Nothing is sent twice.
                error = call_error("not_found", f"no file {_shown(wanted)} of this job's SDK is left to send")
                self._send({"id": message["id"], "ok": False, "error": error})
            else:
                self.sdk_sent.add(wanted)
                self._send({"id": message["id"], "ok": True, "result": self._sdk_file(wanted, message.get("magic"))})
        elif op == "done" and self.keep and message.get("job") != self.job_info.get("call_id"):
            # A session's earlier job's (its code sent one itself, then its runner its own): not this
            # job's result, whatever it says. A sandbox of one job has no other job's to send. Said
            # once a job: code sending them by the thousand must not flood the log.
            if not self.foreign_results:
                job = self.job_info.get("call_id")
                logger.warning("a result frame of another job of the session was dropped", extra={"call_id": job})
            self.foreign_results += 1
        elif op == "done" and self.result is None and _valid_result(message):
            self.result = message if size <= self.max_frame else _result_held_to(message, self.max_frame)
        elif op == "done":
            self._end("failed", "BridgeError", "the sandbox sent a second or malformed result frame")
        elif op in ("call", "key", "sdk"):
            self._end("failed", "BridgeError", f"the sandbox sent a bridge frame (op={_shown(op)}) without a whole-number id")
        else:
            self._end("failed", "BridgeError", f"the sandbox sent an unknown bridge frame (op={_shown(op)})")

    def _sdk_file(self, name: str, magic: Any) -> dict[str, Any]:
        """The SDK file ``name``, for the sandbox: its text, and a module's bytecode too when the
        sandbox's interpreter reads this one's (``magic``), so the import compiles nothing."""
        return sdk_file_packed(name, self.sdk_files[name], compiled=name.endswith(".py") and magic == MAGIC)

    def _job_key(self, call_id: Any) -> dict[str, Any]:
        """The reply to the code's ask for the key of job ``call_id``: made on the first ask, the
        same after. An ask of an earlier job of the session (a thread it left) gets an error."""
        if call_id != self.job_info.get("call_id"):
            return {"ok": False, "error": call_error("job_ended", "the key asked for is an ended job's")}
        if self.key is None and self.key_error is None:
            if self.make_key is None:
                self.key_error = call_error("internal_error", "this sandbox's job has no job-scoped key")
            else:
                self.key_asked = True  # before: a key written whose making then failed is still revoked
                try:
                    self.key = self.make_key()
                except Exception:  # the code gets a ToolError (each time it asks); the job goes on
                    logger.exception("could not make a job's key")
                    self.key_error = call_error("internal_error", "the job's key could not be made; see the worker's log")
        if self.key is None:
            return {"ok": False, "error": self.key_error}
        return {"ok": True, "result": self.key}

    def _busy(self) -> int:
        """The calls of the job in flight: its code's (submitted, or being submitted) and those it
        makes over HTTP with its key. Its code's next call waits while they fill its parallel cap."""
        return len(self.in_flight) + self.submitting + len(self.key_in_flight)

    def _dispatch(self, message: dict[str, Any]) -> None:
        toolset, tool = message.get("toolset"), message.get("tool")
        if not isinstance(toolset, str) or not isinstance(tool, str):
            self._end("failed", "BridgeError", "the sandbox sent a call frame without toolset and tool names")
            return
        self.submitting += 1
        self.to_submit.append((message["id"], toolset, tool, message.get("args")))

    def _flush_submits(self) -> None:
        """Hand what was dispatched since the last wake-up to the submit threads, starting as many
        as are idle. Each takes its share of what is waiting when it is free, so the calls that
        arrive while the threads are busy go out in a few large batches: a batch costs about as
        much as one call (one INSERT, one hold of credits, one producer)."""
        if not self.to_submit:
            return
        if len(self.to_submit) == 1 and self.submitting == 1 and not self.in_flight:
            # A lone call (the code calls one tool at a time) goes out from this thread: a hand-off
            # to a submit thread and back cost more than its wait, and nothing else is in flight.
            (request_id, toolset, tool, args) = self.to_submit.pop()
            self._submitted(request_id, self._submit_batch([(toolset, tool, args)])[0])
            self._fill_slots()
            return
        with self.submit_lock:
            self.unsubmitted += self.to_submit
            self.to_submit = []
            start = min(SUBMIT_THREADS - self.submitters, len(self.unsubmitted))
            self.submitters += start
        for _ in range(start):
            self.submitter.submit(self._submit_waiting)

    def _submit_waiting(self) -> None:
        """On a submit thread: submit the calls waiting, a share at a time, until none is (or the
        job has ended: what was not submitted then is dropped, never recorded)."""
        while True:
            with self.submit_lock:
                if not self.unsubmitted or self.submit_stopped:
                    self.submitters -= 1
                    return
                size = -(-len(self.unsubmitted) // self.submitters)
                batch, self.unsubmitted = self.unsubmitted[:size], self.unsubmitted[size:]
            self._submit(batch)

    def _submit(self, batch: list[tuple[int, str, str, Any]]) -> None:
        """On a submit thread: hand a batch to the router, then wake the loop with the outcomes."""
        outcomes = self._submit_batch([(toolset, tool, args) for _, toolset, tool, args in batch])
        for (request_id, *_), outcome in zip(batch, outcomes, strict=True):
            self.submitted.put((request_id, outcome))
        os.write(self._wake_w, b"\0")

    def _submit_batch(self, requests: list[tuple[str, str, Any]]) -> list[Dispatched | Refused | None]:
        """Return the router's outcome for each call (None: it could not be submitted)."""
        try:
            return list(self.router.submit_many(requests))
        except Exception:  # a failure here is these calls', never the job's or the worker's
            logger.exception("could not submit tool calls")
            return [None] * len(requests)

    def _on_submitted(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        while True:
            try:
                request_id, submitted = self.submitted.get_nowait()
            except queue.Empty:
                break
            self._submitted(request_id, submitted)
        self._fill_slots()

    def _submitted(self, request_id: int, submitted: Dispatched | Refused | None) -> None:
        """Take a submitted call's outcome: answer the code if it was refused, else wait for it."""
        self.submitting -= 1
        if submitted is None:
            error = call_error("internal_error", "the call could not be recorded; see the worker's log")
            self._send({"id": request_id, "ok": False, "call_id": "", "error": error})
        elif isinstance(submitted, Refused):
            self._send({"id": request_id, "ok": False, "call_id": submitted.call_id, "error": submitted.error})
        elif submitted.call_id in self.early:  # the tool was faster than this loop
            self._count_tool_bytes(
                self._send({"id": request_id, "call_id": submitted.call_id, **self.early.pop(submitted.call_id)})
            )
        else:
            # A call waiting on a person has no worker to be late: its timeout is the whole wait.
            grace = 0.0 if submitted.awaiting else CALL_GRACE_SECONDS
            deadline = time.monotonic() + submitted.timeout + grace
            self.in_flight[submitted.call_id] = _InFlight(request_id, deadline)
            if submitted.awaiting:
                self._set_awaiting(submitted.call_id, True)

    def _fill_slots(self) -> None:
        while self.waiting and self._busy() < self.limits.max_parallel_tool_calls and self.ended is None:
            self._dispatch(self.waiting.popleft())

    def _reply(self, call_id: str, reply: dict[str, Any]) -> None:
        call = self.in_flight.pop(call_id, None)
        self._set_awaiting(call_id, False)
        if call is None:
            if self.submitting and len(self.early) < MAX_EARLY_RESULTS:
                self.early[call_id] = reply  # its submission's outcome is still on its way to this loop
            return  # otherwise a late or repeated hand-off for a call already answered
        self._count_tool_bytes(self._send({"id": call.request_id, "call_id": call_id, **reply}))
        self._fill_slots()

    def _send(self, message: dict[str, Any]) -> int:
        """Queue ``message`` for the sandbox; return its size."""
        frame = encode(message)
        self.outbox += frame
        if len(self.outbox) > self.max_buffered:
            # The sandbox's reader has stopped (SIGSTOP, a held lock): don't hold its replies forever.
            self.outbox.clear()
            self._end("failed", "ResourceLimit", f"the code left over {self.max_buffered} bytes of tool results unread")
        return len(frame)

    def _count_tool_bytes(self, size: int) -> None:
        """Add a call's frame or its answer to what the job's calls passed; end it past its bound, counted
        with what its calls over HTTP passed."""
        self.tool_bytes += size
        if self.max_tool_bytes and self.tool_bytes + self.http_tool_bytes > self.max_tool_bytes:
            self._end(
                "failed",
                "ResourceLimit",
                f"the job's tool calls passed over {self.max_tool_bytes} bytes of arguments and results in all "
                "(PTC_MAX_JOB_TOOL_BYTES): pass less through tools, or split the work into several jobs",
            )

    def _approved(self, message: Approved, *, ago: float = 0.0) -> None:
        """The call was approved (``ago`` seconds back): it now runs on a tools worker, under the
        tool's own timeout, and its job's clock runs again from then."""
        call = self.in_flight.get(message.call_id)
        if call is not None and message.call_id in self.awaiting:
            self._set_awaiting(message.call_id, False, ago=ago)
            call.deadline = time.monotonic() - ago + message.timeout + CALL_GRACE_SECONDS

    def _on_channel(self, message: Message) -> None:
        if isinstance(message, Result):
            self._reply(message.call_id, message.reply())
        elif isinstance(message, Approved):
            self._approved(message)
        elif isinstance(message, Ask):
            self._ask(message)
        elif isinstance(message, Released):
            if not message.counted and message.call_id in self.key_in_flight:
                self.key_calls -= 1  # admitted, then refused before it was recorded: no call of the job
            self._key_calls_release([message.call_id])
            self.http_tool_bytes = max(self.http_tool_bytes, message.tool_bytes)
            self._count_tool_bytes(0)
        elif isinstance(message, Admitted):
            if message.call_id not in self.key_in_flight:
                self.key_calls += 1  # recorded without asking this bridge (an older web): counted now
            elif isinstance(message.timeout, int | float) and message.timeout > 0:
                # Its tools worker runs it, and its caller waits for it, by its tool's timeout as it is
                # now: one raised since the job started held its slot shorter than the call ran.
                self.key_in_flight[message.call_id] = _key_call_deadline(time.monotonic(), message.timeout)
            self.http_tool_bytes = max(self.http_tool_bytes, message.tool_bytes)
            self._count_tool_bytes(0)
        elif isinstance(message, Cancel):
            self._end("cancelled", "Cancelled", "the job was cancelled")
        elif isinstance(message, Resync):
            # The channel reconnected: a cancel, results or approvals pushed while it was down are
            # lost; the records are not.
            if not self.heartbeat():
                self._end("cancelled", "Cancelled", "the job was ended while it ran")
                return
            for call_id in list(self.in_flight):
                found = self.router.lookup(call_id=call_id)
                if found.approved is not None:  # while it waited: its clock runs from the approval
                    self._approved(found.approved, ago=found.approved_ago)
                if found.reply is not None:  # (approved, it may have run and ended meanwhile)
                    self._reply(call_id, found.reply)
            # A call over HTTP whose Released was lost has ended by its record.
            self._key_calls_check(settled_before=None)

    def _ask(self, ask: Ask) -> None:
        """Answer a call over HTTP with the job's key that asks to start: admitted while the job runs,
        has made fewer than its max_tool_calls calls (its code's and these together) and has fewer
        than its parallel cap in flight; else refused with the code its caller answers. The same
        call asking again (its answer was lost) is answered the same, counted once, while the job
        runs."""
        limits = self.limits
        granted: Granted | dict[str, str] = Granted(tool_id="", timeout=0.0)
        if ask.toolset and not self.stopped:
            # The tool of the job's grant as it started, as its code's calls have it (a toolset
            # disabled or made private since is the tools worker's to refuse, for both).
            granted = self.router.granted(toolset=str(ask.toolset), tool=str(ask.tool))
        if isinstance(granted, dict):
            answer = Answer(call_id=ask.call_id, ok=False, code=granted["code"], message=granted["message"])
        elif self.ended is not None or self.result is not None or self.stopped:
            # Asking again too (admitted before): the job's grant is no longer looked up.
            answer = Answer(call_id=ask.call_id, ok=False, code="job_ended")
        elif ask.call_id in self.key_in_flight:
            answer = Answer(call_id=ask.call_id, ok=True, tool_id=granted.tool_id, epoch=self.key_epoch)
        elif self.calls + self.key_calls >= limits.max_tool_calls:
            answer = Answer(call_id=ask.call_id, ok=False, code="tool_call_limit", limit=limits.max_tool_calls)
        elif self._busy() >= limits.max_parallel_tool_calls:
            answer = Answer(call_id=ask.call_id, ok=False, code="parallel_limit", limit=limits.max_parallel_tool_calls)
        else:
            self.key_calls += 1
            now = time.monotonic()
            # Till it is recorded, by its tool's timeout as the job started (its Admitted says it as it is).
            self.key_in_flight[ask.call_id] = _key_call_deadline(now, granted.timeout)
            self.key_admitted[ask.call_id] = now
            answer = Answer(call_id=ask.call_id, ok=True, tool_id=granted.tool_id, epoch=self.key_epoch)
        backplane().publish(call_channel(ask.call_id), answer)

    def _key_calls_release(self, call_ids: list[str]) -> None:
        """Free the slots of these calls over HTTP (ended, or past their deadline); the code's calls
        waiting for one take them."""
        freed = [call_id for call_id in call_ids if self.key_in_flight.pop(call_id, None) is not None]
        for call_id in freed:
            del self.key_admitted[call_id]
        if freed:
            self._fill_slots()

    def _key_calls_check(self, *, settled_before: float | None) -> None:
        """Free the slots of calls over HTTP whose records have ended (their Released was lost); with
        ``settled_before``, if any admitted before then has no record (its web process died before
        it recorded it, or stalls), of every call with no record: fenced first (``calls_fence``),
        none of them will ever be, and they are no call of the job's count. A call whose record
        can't be read, or a fence that can't be raised, keeps its slot, until its deadline at most."""
        if settled_before is None:
            call_ids = list(self.key_in_flight)
        else:
            call_ids = [call_id for call_id, at in self.key_admitted.items() if at < settled_before]
        found = self.router.calls_open(call_ids=call_ids) if call_ids else None
        if found is None:
            return
        unrecorded: list[str] = []
        if settled_before is not None and any(call_id not in found for call_id in call_ids):
            # Its web process may yet go on and record it (a pause, a lock), with others admitted in
            # its place by then: the job past its limits. Fenced, it can't; nor can any call admitted
            # so far that is not recorded now, all of which are then given up (a live one asks again).
            # Raised here whether the fence is or not: one that committed with its reply lost left
            # the database's ahead, and each call admitted under the one before was refused as it
            # was recorded, asked again and admitted under it again, till the next fence. Ahead of
            # the database's, an epoch refuses nothing.
            self.key_epoch += 1
            if not self.router.calls_fence(epoch=self.key_epoch):
                return
            call_ids = list(self.key_in_flight)
            found = self.router.calls_open(call_ids=call_ids)
            if found is None:
                return
            unrecorded = [call_id for call_id in call_ids if call_id not in found]
        self.key_calls -= len(unrecorded)
        self._key_calls_release([call_id for call_id in call_ids if found.get(call_id) is False] + unrecorded)

    def _end(self, status: str, kind: str, message: str) -> None:
        if self.ended is None:
            self.ended = Outcome(status=status, error=job_error(kind, message))

    # -- the result ------------------------------------------------------------------------------
    def _guest_limits(self) -> dict[str, int]:
        """The limits the sandbox runs under: a session's were given in its first start frame, for
        its whole life (``extra["limits"]``), a job's own sandbox gets the job's."""
        return self.extra.get("limits") or self.limits.guest()

    def _outcome(self, returncode: int) -> Outcome:
        if self.result is not None:
            error = self.result.get("error")  # _valid_result: None, or its type and message are text
            if error:  # as the API shows a job's error (a ToolError's with its tool, call and code), nothing else
                trace = error.get("traceback")
                shown = job_error(error["type"], error["message"], trace if isinstance(trace, str) else "")
                shown.update({name: error[name] for name in ("tool", "call_id", "code") if isinstance(error.get(name), str)})
                error = shown
            return Outcome(
                status="failed" if error else "completed",
                return_value=self.result.get("return_value"),
                error=error,
                files=_list_of(self.result.get("files"), dict),
                files_omitted=_list_of(self.result.get("files_omitted"), str),
                files_removed=_list_of(self.result.get("files_removed"), str),
            )
        if returncode < 0 or returncode > 128:
            signum = -returncode if returncode < 0 else returncode - 128
            if signum == signal.SIGXCPU:
                kind, text = "ResourceLimit", f"CPU time limit of {self._guest_limits()['cpu_seconds']} s reached"
            elif signum == signal.SIGKILL and self.out_of_memory:
                memory = self._guest_limits()["memory_bytes"] >> 20
                kind, text = "ResourceLimit", f"memory limit of {memory} MiB reached by the job's processes together"
            else:
                kind, text = "SandboxCrashed", f"the sandbox was killed by signal {_signal_name(signum)}"
        else:
            kind = "SandboxCrashed"
            text = f"the code exited with status {returncode} before finishing (os._exit, or a crash)"
        return Outcome(status="failed", error=job_error(kind, text))


def _pending(pipe: io.BufferedReader) -> int:
    """How many bytes wait in ``pipe``. Only the kernel's: ``read1`` of a size past the buffer's,
    as the loop reads, leaves nothing read ahead in it."""
    waiting = bytearray(4)
    fcntl.ioctl(pipe.fileno(), termios.FIONREAD, waiting)
    return int.from_bytes(waiting, sys.byteorder)


def _list_of(value: Any, kind: type) -> list[Any]:
    """The items of ``value`` of type ``kind``: what a sandbox sends is checked, never trusted."""
    return [item for item in value if isinstance(item, kind)] if isinstance(value, list) else []


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return str(signum)


def _result_held_to(message: dict[str, Any], max_frame: int) -> dict[str, Any]:
    """A done frame over ``max_frame``, as the runner sends one whose value is over it (a frame sent
    by hand is not checked by the runner): what it says of the files is the quota's, but its value,
    or its error, measured as the runner measures them, is refused: ResourceLimit."""
    size = len(encode({"op": "done", "return_value": message.get("return_value"), "error": message.get("error")}))
    if size <= max_frame:
        return message
    error = f"the return value is {size} bytes of JSON; the limit is {max_frame}: print it instead"
    return {**message, "return_value": None, "error": {"type": "ResourceLimit", "message": error, "traceback": ""}}


def _valid_result(message: dict[str, Any]) -> bool:
    """A done frame's error is None or ``{"type": str, "message": str, ...}``, as the API promises."""
    error = message.get("error")
    return error is None or (
        isinstance(error, dict) and isinstance(error.get("type"), str) and isinstance(error.get("message"), str)
    )
