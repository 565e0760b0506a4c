"""The backplane: how the processes push to each other, behind one interface picked once.

It carries two things (ARCHITECTURE.md, "pushed, not polled"):
- **messages on a channel**: a job's channel carries its tool results, approvals and its cancel,
  for its worker, and its calls over HTTP asking its bridge to start and saying they ended; its
  end channel carries its end, for whoever waits on it (so a waiter is not woken by every result);
  a standalone call's channel carries its result, a job's call over HTTP's its bridge's answer.
  Typed: ``Result``, ``Approved``, ``Ask``, ``Answer``, ``Admitted``, ``Released``, ``Cancel``,
  ``End`` (and ``Resync``, ``Changed`` from the backplane itself);
- **a job's event log**: what the SSE stream and the CLI read, in order, resumable by id.

Two adapters:
- ``RedisBackplane`` (``REDIS_URL`` set): pub/sub for messages, a Redis Stream per job for events;
- ``LocalBackplane`` (the embedded default, no server): unix sockets in a directory for messages,
  an append-only file per job under ``PTC_DATA_DIR/events`` for events (its readers woken by
  ``Changed`` on the job's channel). Every process of an embedded deployment is on one host.

A subscriber is a file descriptor that turns readable when messages arrive, so a waiter blocks in
``select``/``epoll`` and is woken by the publisher. A message reaches the subscribers present when
it is published; the database stays the source of truth, so one that misses a push still finds
the outcome in the records.
"""

import asyncio
import functools
import hashlib
import json
import logging
import os
import queue
import re
import select
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, BinaryIO

from django.conf import settings

from tools.sdk_runtime.protocol import FrameDecoder, encode

logger = logging.getLogger("ptc.backplane")
# A job's event log holds at most this many events (Redis trims the oldest beyond it).
STREAM_MAXLEN = 50_000
# How long an outcome of a call's that the database did not take through all of its task's retries
# is kept for the reaper (Backplane.outcome_keep): it records it once the database is back, and an
# outcome of a call that ended otherwise meanwhile (its job's end, its code's timeout) is never read.
OUTCOME_KEPT_SECONDS = 24 * 3600
# What an event may hold in the log. The events a job's records tell as well (its calls' and its
# end) each repeat a call's input and output, or all of them: a job passing PTC_MAX_JOB_TOOL_BYTES
# wrote about three times that into Redis, the broker's server, kept an hour past its end (so one
# user's jobs could fill it for everyone). Past EVENT_INLINE_BYTES, such an event is logged without
# its fields of over FIELD_INLINE_BYTES (at the top, or one level down: a pending call's ``call``),
# named in ``_omitted``, and its readers fill them in from the records (events.event_filled). What
# is left of an object one level down is kept up to EVENT_INLINE_BYTES: it may be what the records
# no longer say as it was (a pending call's state, whose record has moved on once it is read).
EVENT_INLINE_BYTES = 8 * 1024
FIELD_INLINE_BYTES = 1024
FROM_RECORDS = frozenset(
    ("tool_call_start", "tool_call_pending", "tool_call_approved", "tool_call_end", "tool_call_error", "exec_end")
)


# -- Messages ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Result:
    """A tool call's outcome, for the code waiting on it."""

    call_id: str
    ok: bool
    result: Any = None
    error: dict[str, Any] | None = None

    def reply(self) -> dict[str, Any]:
        return {"ok": True, "result": self.result} if self.ok else {"ok": False, "error": self.error}


@dataclass(frozen=True)
class Approved:
    """A call that waited for an approval was approved and queued: it now runs under ``timeout``."""

    call_id: str
    timeout: float


@dataclass(frozen=True)
class Ask:
    """A call of the job over HTTP, with its key, asks the job's bridge whether it may start: the
    bridge holds the job's count of calls and those in flight, its sandbox's and these together,
    and answers on the call's channel (``call_channel``) with ``Answer``. Admitted, the call holds
    a slot of the job's parallel cap until its ``Released``, or its tool's timeout (as ``Admitted``
    says it) and more at most: a caller that died holds it no longer. ``toolset`` and ``tool`` name
    the tool it calls, which the bridge finds in the job's grant, as it started (none: not looked up)."""

    call_id: str
    toolset: str = ""
    tool: str = ""


@dataclass(frozen=True)
class Answer:
    """The bridge's answer to ``Ask``: ``ok``, with ``tool_id``, the tool of the job's grant it
    calls, and ``epoch``, the job's ``http_admit_epoch`` it is admitted under (by the time it is
    recorded, a later one means the bridge no longer counts it: it asks again); or the code it was
    refused with (``tool_call_limit``, ``parallel_limit``, ``job_ended``, or not in the grant:
    ``toolset_not_granted``, ``unknown_tool``, ``kind_unsupported``, with its ``message``) and the
    ``limit`` it is past."""

    call_id: str
    ok: bool
    code: str = ""
    limit: int = 0
    tool_id: str = ""
    message: str = ""
    epoch: int = 0


@dataclass(frozen=True)
class Admitted:
    """A call of the job over HTTP, with its key, was recorded: ``tool_bytes`` (what its calls over
    HTTP have passed so far) counts against PTC_MAX_JOB_TOOL_BYTES in its sandbox too. One the
    bridge did not admit (``Ask``: an older web's) counts against its max_tool_calls here.
    ``timeout``: its tool's as it is now, which its tools worker runs it under and its caller
    waits for (none if it won't run): its slot is held for that from now, not for the timeout
    the tool had as the job started."""

    call_id: str
    tool_bytes: int = 0
    timeout: float = 0.0


@dataclass(frozen=True)
class Released:
    """A call of the job over HTTP that the bridge admitted has ended, or was not made after all:
    its slot of the parallel cap is free. ``tool_bytes`` as in ``Admitted``, its result's with them.
    Not ``counted``: it was refused after it was admitted (its bytes past the bound, its job ended),
    nothing recorded: no call of the job's count."""

    call_id: str
    tool_bytes: int = 0
    counted: bool = True


@dataclass(frozen=True)
class Cancel:
    """The job was cancelled: its worker kills the sandbox."""


@dataclass(frozen=True)
class End:
    """The job ended with ``status``: wakes whoever waits for it. ``job`` is the job as the API
    shows it at its end (None when too large to push: read the record)."""

    status: str
    job: dict[str, Any] | None = None


@dataclass(frozen=True)
class Resync:
    """The subscription reconnected: what was pushed meanwhile is lost; read the records."""


@dataclass(frozen=True)
class Changed:
    """The job's event log grew (the local backplane's wake-up for its readers)."""


Message = Result | Approved | Ask | Answer | Admitted | Released | Cancel | End | Resync | Changed
# A job's events in order, ``(name, data)``; several jobs' events, ``(job call_id, events)``; and
# messages to push, ``(channel, message)``.
Events = list[tuple[str, dict[str, Any]]]
JobsEvents = list[tuple[str, Events]]
Pushes = list[tuple[str, Message]]
_KINDS: dict[str, type[Message]] = {
    cls.__name__.lower(): cls for cls in (Result, Approved, Ask, Answer, Admitted, Released, Cancel, End, Resync, Changed)
}


def _wire_json(data: dict[str, Any]) -> str:
    """A message as Redis carries it: compact JSON (anything else as text, as events are)."""
    return json.dumps(data, separators=(",", ":"), default=str)


def _to_wire(message: Message) -> dict[str, Any]:
    # Its fields as they are, not ``asdict``'s deep copy: a message is serialised at once, and an
    # End carries the whole job (a copy of every call's input and output, thrown away).
    return {"kind": type(message).__name__.lower(), **{f.name: getattr(message, f.name) for f in fields(message)}}


def _from_wire(data: dict[str, Any]) -> Message | None:
    """The message ``data`` carries, or None if it is none we know. Fields it does not know (a
    newer peer's) are left out."""
    cls = _KINDS.get(str(data.pop("kind", "")))
    if cls is None:
        return None
    known = {f.name for f in fields(cls)}
    try:
        return cls(**{name: value for name, value in data.items() if name in known})
    except TypeError:
        return None


def _slim(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` without its fields of over FIELD_INLINE_BYTES of JSON, their paths (``name``, or
    ``name.field`` one level down in an object of at most EVENT_INLINE_BYTES without them) in
    ``_omitted``."""
    omitted: list[str] = []
    out: dict[str, Any] = {}
    for name, field in data.items():
        if _json_size(field) <= FIELD_INLINE_BYTES:
            out[name] = field
            continue
        inner = (
            {key: value for key, value in field.items() if _json_size(value) <= FIELD_INLINE_BYTES}
            if isinstance(field, dict)
            else {}
        )
        if inner and _json_size(inner) <= EVENT_INLINE_BYTES:
            out[name] = inner
            omitted.extend(f"{name}.{key}" for key in field if key not in inner)
        else:
            omitted.append(name)
    return {**out, "_omitted": omitted}


def _logged(event: str, data: dict[str, Any]) -> str:
    """``data`` as a log keeps it: JSON, slimmed (``_slim``) where it is large and the records tell it."""
    payload = json.dumps(data, separators=(",", ":"), default=str)
    if len(payload) > EVENT_INLINE_BYTES and event in FROM_RECORDS:
        payload = json.dumps(_slim(data), separators=(",", ":"), default=str)
    return payload


def logged_whole(event: str, data: dict[str, Any]) -> bool:
    """Return True if the log keeps ``event`` as given; False if it keeps it without its large
    fields (``_slim``), which its readers then fill in from the records: those must exist by then."""
    return event not in FROM_RECORDS or _json_size(data) <= EVENT_INLINE_BYTES


def _json_size(value: Any) -> int:
    return len(json.dumps(value, separators=(",", ":"), default=str))


def job_channel(call_id: str) -> str:
    """A job's channel, which its worker follows: its tool results, approvals and cancel."""
    return f"{settings.PTC_REDIS_PREFIX}ptc:job:{call_id}"


def job_end_channel(call_id: str) -> str:
    """A job's end channel, which its waiters follow: its ``End`` only."""
    return f"{settings.PTC_REDIS_PREFIX}ptc:job-end:{call_id}"


def call_channel(call_id: str) -> str:
    """A standalone call's channel: its result."""
    return f"{settings.PTC_REDIS_PREFIX}ptc:call:{call_id}"


class Subscription:
    """Messages of one channel, queued by a reader thread; ``fileno()`` is readable while any wait."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Message] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        # Never blocks: a put holds the lock below while it writes, and a full pipe already wakes.
        os.set_blocking(self._wake_w, False)
        self._closed = threading.Event()
        # A reader thread's put and the owner's close: a put after the close would write to a
        # closed pipe's number, which the process may have given to another file since.
        self._lock = threading.Lock()

    def fileno(self) -> int:
        return self._wake_r

    def _put(self, message: Message) -> None:
        with self._lock:
            if self._closed.is_set():
                return
            self._queue.put(message)
            try:
                os.write(self._wake_w, b"\0")
            except OSError:
                pass

    def drain(self) -> list[Message]:
        """Return every queued message without blocking."""
        try:
            while os.read(self._wake_r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass
        messages = []
        while True:
            try:
                messages.append(self._queue.get_nowait())
            except queue.Empty:
                return messages

    def wait(self, timeout: float) -> None:
        """Block until a message is queued or ``timeout`` passes; ``drain`` then returns what came."""
        select.select([self.fileno()], [], [], max(0.0, timeout))

    async def wait_async(self, timeout: float) -> None:
        """``wait`` on the running event loop: woken by ``fileno()``, holding no thread while it
        waits (the loop's pool has the cores + 4 threads, and a stream's reads use them too)."""
        loop = asyncio.get_running_loop()
        readable = asyncio.Event()
        fd = self.fileno()
        loop.add_reader(fd, readable.set)
        try:
            await asyncio.wait_for(readable.wait(), max(0.0, timeout))
        except TimeoutError:
            pass
        finally:
            loop.remove_reader(fd)

    def confirm(self) -> None:
        """Return once the subscription is in place: nothing published after is missed. Raise if
        it can't be (the subscription is then closed)."""

    def close(self) -> None:
        with self._lock:
            if self._closed.is_set():
                return
            self._closed.set()
            os.close(self._wake_r)
            os.close(self._wake_w)
        self._stop()

    def _stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> "Subscription":
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


class _RedisSubscription(Subscription):
    def __init__(self, hub: "_RedisHub", channel: str) -> None:
        super().__init__()
        self._hub, self.channel = hub, channel
        self._confirmed = hub.add(self)  # set once Redis has confirmed the SUBSCRIBE

    def confirm(self) -> None:
        if not self._confirmed.wait(SUBSCRIBE_TIMEOUT):
            self.close()
            raise TimeoutError(f"Redis did not confirm the subscription to {self.channel}")

    def _stop(self) -> None:
        self._hub.remove(self)


class _DirectSubscription(_RedisSubscription):
    """One channel on a pub/sub connection of its own, read by the thread that owns the
    subscription: ``fileno()`` is the connection's socket, so a message wakes that thread itself,
    where through the hub it wakes the hub's reader, which hands it over through a pipe (a running
    job's tool results: a thread hand-off less on every call). Its connection is one of a few this
    process keeps (``_DirectConnections``), given back when the subscription closes.

    Should the connection fail (or redis-py remake it under us), the channel is followed through
    the hub from then on, as any other, and a ``Resync`` is queued once the hub has it (what was
    pushed meanwhile is lost: the records say it); ``fileno()`` is then the hub's pipe, so a
    selector that registered the socket registers ``fileno()`` again once it differs. The socket's
    number stays held until the subscription closes: no other file takes it meanwhile."""

    def __init__(self, hub: "_RedisHub", connections: "_DirectConnections", channel: str) -> None:
        Subscription.__init__(self)
        self._hub, self._connections, self.channel = hub, connections, channel
        self._key = channel.encode()
        self._early: list[Message] = []  # read while waiting for the confirmation, for drain
        self._subscribed = False
        self._retry: threading.Timer | None = None
        self._pubsub: Any = connections.take()
        try:
            self._pubsub.subscribe(channel)
            self._sock = self._pubsub.connection._sock
            self._fd = os.dup(self._sock.fileno())  # the number held (see above), and what a selector watches
        except BaseException:
            self._pubsub.close()
            os.close(self._wake_r)
            os.close(self._wake_w)
            raise

    def fileno(self) -> int:
        return self._fd if self._pubsub is not None else self._wake_r

    def confirm(self) -> None:
        deadline = time.monotonic() + SUBSCRIBE_TIMEOUT
        while self._pubsub is not None and not self._subscribed:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.close()
                raise TimeoutError(f"Redis did not confirm the subscription to {self.channel}")
            self._read(timeout=remaining)

    def drain(self) -> list[Message]:
        if self._pubsub is not None:
            self._read(timeout=0)
        if self._pubsub is not None:
            messages, self._early = self._early, []
            return messages
        messages, self._early = self._early, []  # read before the connection failed
        return messages + super().drain()

    def _read(self, *, timeout: float) -> None:
        """Read what the connection has (waiting up to ``timeout`` for a first message); on a
        failure, follow the channel through the hub."""
        try:
            message = self._pubsub.get_message(timeout=timeout)
            while message is not None:
                self._take(message)
                message = self._pubsub.get_message(timeout=0)
            if self._pubsub.connection is None or self._pubsub.connection._sock is not self._sock:
                raise ConnectionError("the connection was made again")  # its subscription's pushes lost meanwhile
        except Exception as exc:
            logger.warning("a subscription's own connection failed (%s); following its channel through the hub", exc)
            self._pubsub.close()
            self._pubsub = None
            self._through_hub()

    def _take(self, message: dict[str, Any]) -> None:
        # A connection kept from an earlier subscription may still bring that one's last messages.
        if message.get("channel") != self._key:
            return
        if message.get("type") == "subscribe":
            self._subscribed = True
        elif message.get("type") == "message" and (decoded := _from_wire(json.loads(message["data"]))) is not None:
            self._early.append(decoded)

    def _through_hub(self) -> None:
        """Subscribe through the hub (every half second until Redis takes it); queue a Resync once it
        is confirmed."""
        if self._closed.is_set():
            return
        try:
            confirmed = self._hub.add(self)
        except Exception:
            self._retry = threading.Timer(0.5, self._through_hub)
            self._retry.daemon = True
            self._retry.start()
            return
        if self._closed.is_set():  # closed meanwhile (a retry's timer): its close found nothing to remove
            self._hub.remove(self)
            return

        def resync() -> None:
            confirmed.wait(SUBSCRIBE_TIMEOUT)  # pushes from here on arrive; those before are in the records
            self._put(Resync())

        threading.Thread(target=resync, name="ptc-resync", daemon=True).start()

    def _stop(self) -> None:
        if self._retry is not None:
            self._retry.cancel()
        if self._pubsub is not None:
            self._connections.give_back(self._pubsub, self.channel)
            self._pubsub = None
        else:
            self._hub.remove(self)
        os.close(self._fd)


class _DirectConnections:
    """The pub/sub connections of this process's direct subscriptions, kept between them (a job's
    subscription takes one as it starts: no connect on its path), at most ``most`` idle."""

    def __init__(self, client: Any, most: int = 64) -> None:
        self._client, self._most = client, most
        self._idle: list[Any] = []
        self._lock = threading.Lock()

    def take(self) -> Any:
        """An idle connection, its last subscription's leftovers read (one lost while idle is closed),
        or a new one."""
        while True:
            with self._lock:
                pubsub = self._idle.pop() if self._idle else None
            if pubsub is None:
                return self._client.pubsub()
            try:
                while pubsub.get_message(timeout=0) is not None:
                    pass
                # Its unsubscribe answered, redis-py reads it no more: nothing is due on it, and one
                # readable was closed by Redis while idle (its `timeout` for idle clients spares only
                # those subscribed; a restart), which can_read raises. A subscription sent down it was
                # lost, and its job followed its channel through the hub, after a Resync.
                if pubsub.connection is not None and (pubsub.subscribed or not pubsub.connection.can_read(timeout=0)):
                    return pubsub
            except Exception:  # lost while idle
                pass
            pubsub.close()

    def give_back(self, pubsub: Any, channel: str) -> None:
        """Unsubscribe ``pubsub`` from ``channel`` and keep it idle; close it if that fails or enough are kept."""
        try:
            pubsub.unsubscribe(channel)
        except Exception:
            pubsub.close()
            return
        with self._lock:
            if len(self._idle) < self._most:
                self._idle.append(pubsub)
                return
        pubsub.close()


# How long a subscription waits for Redis to confirm it before it counts as failed.
SUBSCRIBE_TIMEOUT = 5.0
# How long the reader waits on its connection at a time.
READ_TIMEOUT = 1.0


# The name of each process's subscription connection in Redis's CLIENT LIST.
SUBSCRIPTIONS_CLIENT = "ptc-subscriptions"


def _named_connection(base: Any) -> Any:
    """``base`` (redis-py's connection class of the URL's scheme), naming each connection it opens
    SUBSCRIPTIONS_CLIENT, so an operator tells it in CLIENT LIST (as a test that cuts it does). If
    Redis refuses the name (an ACL without CLIENT: NOPERM) it goes unnamed: redis-py's own
    ``client_name`` raises that from the connect, and no subscription could ever be made."""
    from redis.exceptions import ResponseError

    class Named(base):
        def on_connect_check_health(self, check_health: bool = True) -> None:
            super().on_connect_check_health(check_health=check_health)
            self.send_command("CLIENT", "SETNAME", SUBSCRIPTIONS_CLIENT, check_health=False)
            try:
                self.read_response()
            except ResponseError:
                pass

    return Named


class _RedisHub:
    """Every subscription of this process on one pub/sub connection and one reader thread: a
    subscription is one SUBSCRIBE on it, not a connection and a thread of its own (a web process
    with a thousand clients waiting on their jobs holds one connection, not a thousand).

    redis-py's PubSub is not thread-safe, so every call on it is made under ``lock``; the reader
    waits for data on the connection outside the lock, so subscribing never waits for a message.
    """

    def __init__(self, client: Any) -> None:
        self._client = client
        self._lock = threading.Lock()
        self._pubsub: Any = None
        self._channels: dict[bytes, set[_RedisSubscription]] = {}
        self._confirmed: dict[bytes, threading.Event] = {}
        self._thread: threading.Thread | None = None

    def add(self, subscription: _RedisSubscription) -> threading.Event:
        """Subscribe ``subscription`` to its channel: return the event set once Redis has confirmed
        it. Raises if Redis can't be reached."""
        channel = subscription.channel.encode()
        with self._lock:
            if self._pubsub is None:
                self._pubsub = self._client.pubsub()
            subscribers = self._channels.setdefault(channel, set())
            subscribers.add(subscription)
            confirmed = self._confirmed.get(channel)
            if confirmed is None:
                confirmed = self._confirmed[channel] = threading.Event()
                try:
                    self._pubsub.subscribe(channel)
                except Exception:
                    self._forget(subscription)
                    raise
            if self._thread is None:
                self._thread = threading.Thread(target=self._read, name="ptc-subscriptions", daemon=True)
                self._thread.start()
        return confirmed

    def remove(self, subscription: _RedisSubscription) -> None:
        """Drop ``subscription``; the channel's last one unsubscribes it. Never raises: a broken
        connection has no subscription to undo."""
        with self._lock:
            if self._forget(subscription):
                try:
                    self._pubsub.unsubscribe(subscription.channel.encode())
                except Exception:  # resubscribing after a reconnect leaves it out
                    pass

    def _forget(self, subscription: _RedisSubscription) -> bool:
        """Drop ``subscription`` (the lock held). Return True if its channel has no other."""
        channel = subscription.channel.encode()
        subscribers = self._channels.get(channel, set())
        subscribers.discard(subscription)
        if subscribers:
            return False
        self._channels.pop(channel, None)
        self._confirmed.pop(channel, None)
        return True

    def _read(self) -> None:
        broken = False
        while True:
            try:
                with self._lock:
                    if broken:
                        self._pubsub.ping()  # reconnects here, under the lock (resubscribing), or raises
                    connection = self._pubsub.connection
                ready = connection.can_read(timeout=READ_TIMEOUT)  # blocks on the socket, outside the lock
                with self._lock:
                    messages = []
                    while (message := self._pubsub.get_message(timeout=0)) is not None:
                        messages.append(message)
                    # Data that redis-py won't read (it reads nothing while nothing is subscribed):
                    # only then would the loop spin. A wait that timed out is no reason to sleep: a
                    # SUBSCRIBE sent during that sleep had its confirmation wait up to 50 ms.
                    idle = ready and not messages and not self._pubsub.subscribed
            except Exception:  # Redis went away; retried every half second
                broken = True
                time.sleep(0.5)
                continue
            if broken:
                broken = False
                with self._lock:
                    everyone = [sub for subscribers in self._channels.values() for sub in subscribers]
                for subscription in everyone:
                    subscription._put(Resync())  # what was pushed meanwhile is lost: look at the records
            for message in messages:
                self._deliver(message)
            if idle:
                time.sleep(0.05)  # data for no one (a message after the last unsubscribe): don't spin on it

    def _deliver(self, message: dict[str, Any]) -> None:
        channel = message.get("channel")
        with self._lock:
            if message.get("type") == "subscribe":
                confirmed = self._confirmed.get(channel)  # type: ignore[arg-type]
                if confirmed is not None:
                    confirmed.set()
                return
            subscribers = list(self._channels.get(channel, ())) if message.get("type") == "message" else []  # type: ignore[arg-type]
        if subscribers and (decoded := _from_wire(json.loads(message["data"]))) is not None:
            for subscription in subscribers:
                subscription._put(decoded)


def _socket_dir(channel: str) -> Path:
    # Unix socket paths are limited to 108 bytes: keep them short and under the temp dir.
    base = hashlib.sha256(str(settings.DATA_DIR).encode()).hexdigest()[:10]
    return Path(tempfile.gettempdir()) / f"ptc-ch-{base}" / hashlib.sha256(channel.encode()).hexdigest()[:20]


def _socket_dir_drop(directory: Path) -> None:
    """Remove a channel's folder once it holds no subscriber's socket: each job has channels of its
    own, and their folders, left behind, took an inode and a block each per job, for ever."""
    try:
        directory.rmdir()
    except OSError:  # a subscriber's socket is there (or came meanwhile), or it went already
        pass


class _SocketSubscription(Subscription):
    def __init__(self, channel: str) -> None:
        super().__init__()
        directory = _socket_dir(channel)
        self._path = directory / f"{uuid.uuid4().hex[:12]}.sock"
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # The channel's last subscriber removes its folder as it leaves (_socket_dir_drop): one
        # that does between this mkdir and the bind makes the bind miss it; made again, it holds.
        for attempt in range(100):
            directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            try:
                self._server.bind(str(self._path))
                break
            except FileNotFoundError:
                if attempt == 99:
                    self._server.close()
                    raise
        self._server.listen(64)
        self._thread = threading.Thread(target=self._accept, name=f"sub-{channel}", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            with conn:
                decoder = FrameDecoder()
                while chunk := conn.recv(1 << 16):
                    for message in decoder.feed(chunk):
                        if (decoded := _from_wire(message)) is not None:
                            self._put(decoded)

    def _stop(self) -> None:
        try:
            self._path.unlink()
        except FileNotFoundError:
            pass
        self._server.close()
        _socket_dir_drop(self._path.parent)


def _socket_publish(channel: str, message: dict[str, Any]) -> None:
    directory = _socket_dir(channel)
    if not directory.is_dir():
        return
    frame = encode(message)
    for path in directory.glob("*.sock"):
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.settimeout(5)
                conn.connect(str(path))
                conn.sendall(frame)
        except (ConnectionRefusedError, FileNotFoundError):
            path.unlink(missing_ok=True)  # its subscriber died without cleaning up
            _socket_dir_drop(directory)
        except OSError:
            continue


# -- The interface -------------------------------------------------------------------------------
class Backplane:
    """Messages on channels and each job's event log (once it has expired, its readers rebuild a
    job's events from its records)."""

    def subscribe(self, channel: str, *, confirmed: bool = True) -> Subscription:
        """Start receiving ``channel``'s messages; with ``confirmed``, return once the subscription
        is in place, else at once (``confirm()`` it before relying on it, and do other work while
        the server confirms it). Close the subscription when done."""
        subscription = self._subscribe(channel)
        if confirmed:
            subscription.confirm()
        return subscription

    def _subscribe(self, channel: str) -> Subscription:
        raise NotImplementedError

    def subscribe_direct(self, channel: str) -> Subscription:
        """``subscribe`` (not confirmed), for one thread that waits on it in its own selector, reading
        what comes itself where the backplane can (Redis: a connection of its own), with no hand-off
        from another thread. Its ``fileno()`` may change once (its connection failed): a selector
        registers the new one."""
        return self._subscribe(channel)

    def _publish(self, channel: str, data: dict[str, Any]) -> None:
        raise NotImplementedError

    def publish(self, channel: str, message: Message) -> bool:
        """Push ``message`` to everyone subscribed to ``channel`` now. Return False if it could not
        be sent: never raises, since every push has a fallback on the records (a subscriber
        resyncs after a reconnect, a call past its deadline is looked up, a running job's heartbeat
        finds it cancelled, a waiter times out and reads the record)."""
        try:
            self._publish(channel, _to_wire(message))
        except Exception:  # see above: the records stay the truth
            logger.warning("could not publish on %s", channel, exc_info=True)
            return False
        return True

    def wait_for(self, channel: str, *, done: Callable[[], bool], match: Callable[[Message], bool], timeout: float) -> bool:
        """Block until ``done()`` is true or a message on ``channel`` satisfies ``match``, at most
        ``timeout`` seconds. Return whether it happened. Subscribed before ``done()`` is first
        asked, so a push in between is never missed; ``done`` is asked again after every wake-up,
        so a lost push costs the timeout at worst, never the outcome. Raises if the channel
        can't be reached at all."""
        from django.db import connection

        deadline = time.monotonic() + timeout
        with self.subscribe(channel) as subscription:
            while not done():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                connection.close()  # not held while blocked: the pool is for those who query
                subscription.wait(remaining)
                if any(match(message) for message in subscription.drain()):
                    return True
            return True

    def ping(self) -> None:
        """Raise if the backplane's server can't be reached (nothing to reach without one)."""

    def events_append(self, job_call_id: str, events: Events, *, expire: int | None = None) -> None:
        """Append events to the job's log in one round trip, in order. Never raises: a lost event
        must not fail the job (the records stay the truth). ``expire``: the log's expiry, in
        seconds from now, unless its end is among them (which sets the retention)."""

    def publish_then_append(self, messages: Pushes, events: JobsEvents) -> None:
        """Push ``messages`` ``(channel, message)``, then append ``events`` ``(job call_id, events)``
        to their jobs' logs, in one round trip where the backplane has one (Redis): results reach
        their code before their watchers hear of them. Where the two are separate steps (the
        embedded log), the events are appended first (``_send``). Never raises (``publish`` and
        ``events_append`` say why)."""
        self._send(messages, events, events_first=False)

    def append_then_publish(self, events: JobsEvents, messages: Pushes) -> None:
        """``publish_then_append`` the other way round: whoever a message wakes finds the events
        in the log already (a job's end, then its waiters). Never raises."""
        self._send(messages, events, events_first=True)

    def call_end_push(self, messages: Pushes, *, job_call_id: str, call_id: str, end: tuple[str, dict[str, Any]]) -> None:
        """Push ``messages``, then append call ``call_id``'s ``end`` (its ``tool_call_end`` or
        ``tool_call_error``) to job ``job_call_id``'s log unless the log has an end of that call
        already, or has no log (expired, or never written: its readers take the records, which
        have it); in one round trip where the backplane has one. For whoever finds a call closed
        that it may have closed itself: a finish whose reply was lost after its commit never
        appended the end, and whoever else closed it did. Never raises."""
        events = [(job_call_id, [end])] if job_call_id and self._call_end_missing(job_call_id, call_id) else []
        self._send(messages, events, events_first=False)

    def _call_end_missing(self, job_call_id: str, call_id: str) -> bool:
        """Whether job ``job_call_id`` has a log and no end of call ``call_id`` in it."""
        return False

    def _send(self, messages: Pushes, events: JobsEvents, *, events_first: bool) -> None:
        # Two steps, not one round trip: the events go first, whichever order was asked. A result
        # pushed first woke its code, which could end, and its job's exec_end be appended, before
        # the call's tool_call_end: every stream ends at exec_end, and its watchers never heard
        # the call end (a few jobs in 50 of 16 parallel calls, on the embedded default). A local
        # append costs the code a few microseconds.
        for job_call_id, job_events in events:
            self.events_append(job_call_id, job_events)
        for channel, message in messages:
            self.publish(channel, message)

    def events_read(self, job_call_id: str) -> list[tuple[str, str, dict[str, Any]]]:
        """Return the job's logged events ``(id, name, data)``, oldest first; empty without a log."""
        return []

    def outcome_keep(self, call_id: str, outcome: str) -> bool:
        """Keep what call ``call_id`` came to (``outcome``, signed: services.calls.OutcomeUnrecorded)
        for OUTCOME_KEPT_SECONDS, outside the database, which did not take it. Return whether it is
        kept. Never raises."""
        return False

    def outcomes_kept(self, call_ids: list[str]) -> dict[str, str]:
        """Return the outcomes kept of the calls ``call_ids``, by call id. Never raises: none, if
        they can't be read."""
        return {}

    def outcomes_drop(self, call_ids: list[str]) -> None:
        """Forget the outcomes kept of the calls ``call_ids`` (recorded now). Never raises."""

    def events_drop(self, job_call_ids: list[str]) -> None:
        """Delete these jobs' event logs (they hold output and tool I/O), in one round trip."""

    def events_idle(self, seconds: float) -> list[str]:
        """Return the jobs (call ids) whose log was not written for ``seconds``, for the retention
        round to drop those of ended jobs; none where the logs expire by themselves (Redis)."""
        return []


# RedisBackplane.call_end_push's append: KEYS[1] a job's log; ARGV the call's id, its end's name and
# data, the log's most entries. Looked for from the log's end back to the call's start (its end
# comes after it); a data field is decoded only if it names the call, as its events' do.
_CALL_END_ONCE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local call, named = ARGV[1], '"call_id":"' .. ARGV[1] .. '"'
local upto, seen = '+', nil
while true do
  local page = redis.call('XREVRANGE', KEYS[1], upto, '-', 'COUNT', 500)
  for _, entry in ipairs(page) do
    if entry[1] ~= seen then
      local name, data = nil, nil
      for i = 1, #entry[2], 2 do
        if entry[2][i] == 'event' then name = entry[2][i + 1] elseif entry[2][i] == 'data' then data = entry[2][i + 1] end
      end
      if data and string.find(data, named, 1, true) then
        local ok, decoded = pcall(cjson.decode, data)
        if ok and type(decoded) == 'table' and decoded.call_id == call then
          if name == 'tool_call_end' or name == 'tool_call_error' then return 0 end
          if name == 'tool_call_start' then upto = nil break end
        end
      end
    end
  end
  if upto == nil or #page < 500 then break end
  upto = page[#page][1]
  seen = upto
end
redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[4], '*', 'event', ARGV[2], 'data', ARGV[3])
return 1
"""


class RedisBackplane(Backplane):
    @functools.cached_property
    def client(self) -> Any:
        import redis

        # A Redis that is down is known in seconds, not after the OS's TCP timeout.
        return redis.Redis.from_url(settings.REDIS_URL, health_check_interval=30, socket_keepalive=True, socket_connect_timeout=2)

    @functools.cached_property
    def hub(self) -> _RedisHub:
        """This process's subscriptions, on a client of their own. Without health checks: those
        would write to the connection from the reader thread, which only reads."""
        import redis

        client = redis.Redis.from_url(settings.REDIS_URL, socket_keepalive=True, socket_connect_timeout=2)
        pool = client.connection_pool
        pool.connection_class = _named_connection(pool.connection_class)
        return _RedisHub(client)

    def _subscribe(self, channel: str) -> Subscription:
        return _RedisSubscription(self.hub, channel)

    @functools.cached_property
    def direct(self) -> _DirectConnections:
        """The pub/sub connections of this process's direct subscriptions, named as the hub's."""
        import redis

        client = redis.Redis.from_url(settings.REDIS_URL, socket_keepalive=True, socket_connect_timeout=2)
        pool = client.connection_pool
        pool.connection_class = _named_connection(pool.connection_class)
        return _DirectConnections(client)

    def subscribe_direct(self, channel: str) -> Subscription:
        return _DirectSubscription(self.hub, self.direct, channel)

    def ping(self) -> None:
        self.client.ping()

    def _publish(self, channel: str, data: dict[str, Any]) -> None:
        self.client.publish(channel, _wire_json(data))

    @staticmethod
    def stream_key(job_call_id: str) -> str:
        return f"{settings.PTC_REDIS_PREFIX}ptc:events:{job_call_id}"

    def events_append(self, job_call_id: str, events: Events, *, expire: int | None = None) -> None:
        if not events:
            return
        try:
            pipe = self.client.pipeline(transaction=False)
            self.events_into(pipe, [(job_call_id, events)])
            if expire is not None and all(event != "exec_end" for event, _ in events):
                pipe.expire(self.stream_key(job_call_id), expire)
            pipe.execute()
        except Exception:  # the records stay the truth; a reader rebuilds from them
            logger.warning("could not append events", extra={"job_id": job_call_id}, exc_info=True)

    def _send(self, messages: Pushes, events: JobsEvents, *, events_first: bool) -> None:
        # One round trip: Redis runs a pipeline's commands in order. A batch of a tools worker's
        # finished calls is one pipeline; so is a job's last event and its end.
        if not messages and not events:
            return
        try:
            pipe = self.client.pipeline(transaction=False)
            if events_first:
                self.events_into(pipe, events)
            for channel, message in messages:
                pipe.publish(channel, _wire_json(_to_wire(message)))
            if not events_first:
                self.events_into(pipe, events)
            pipe.execute()
        except Exception:  # the records stay the truth: see publish and events_append
            logger.warning("could not publish %d messages and their events", len(messages), exc_info=True)

    def call_end_push(self, messages: Pushes, *, job_call_id: str, call_id: str, end: tuple[str, dict[str, Any]]) -> None:
        # The look and the append one script: atomic, so two that find the call closed at once
        # append its end once.
        try:
            pipe = self.client.pipeline(transaction=False)
            for channel, message in messages:
                pipe.publish(channel, _wire_json(_to_wire(message)))
            if job_call_id:
                name, data = end
                pipe.eval(_CALL_END_ONCE, 1, self.stream_key(job_call_id), call_id, name, _logged(name, data), STREAM_MAXLEN)
            pipe.execute()
        except Exception:  # the records stay the truth: see publish and events_append
            logger.warning("could not push a closed call's result and its end", extra={"call_id": call_id}, exc_info=True)

    def events_into(self, pipe: Any, events: JobsEvents) -> None:
        """Add the commands that append ``events`` ``(job call_id, events)`` to ``pipe`` (a sync or
        an asyncio client's: both queue commands as they are called)."""
        for job_call_id, job_events in events:
            key = self.stream_key(job_call_id)
            for event, data in job_events:
                pipe.xadd(key, {"event": event, "data": _logged(event, data)}, maxlen=STREAM_MAXLEN, approximate=True)
                if event == "exec_end":
                    pipe.expire(key, settings.PTC_EVENTS_RETENTION_SECONDS)

    def events_read(self, job_call_id: str) -> list[tuple[str, str, dict[str, Any]]]:
        try:
            entries = self.client.xrange(self.stream_key(job_call_id))
        except Exception:  # a reader falls back on the records
            logger.warning("could not read a job's events", extra={"job_id": job_call_id}, exc_info=True)
            return []
        return [(raw_id.decode(), f[b"event"].decode(), json.loads(f[b"data"])) for raw_id, f in entries]

    def events_drop(self, job_call_ids: list[str]) -> None:
        if job_call_ids:
            self.client.delete(*[self.stream_key(call_id) for call_id in job_call_ids])

    @staticmethod
    def _outcome_key(call_id: str) -> str:
        return f"{settings.PTC_REDIS_PREFIX}ptc:outcome:{call_id}"

    def outcome_keep(self, call_id: str, outcome: str) -> bool:
        try:
            self.client.set(self._outcome_key(call_id), outcome, ex=OUTCOME_KEPT_SECONDS)
        except Exception:
            logger.warning("could not keep a tool call's outcome", extra={"call_id": call_id}, exc_info=True)
            return False
        return True

    def outcomes_kept(self, call_ids: list[str]) -> dict[str, str]:
        if not call_ids:
            return {}
        try:
            found = self.client.mget([self._outcome_key(call_id) for call_id in call_ids])
        except Exception:  # read again at the reaper's next round
            logger.warning("could not read the tool calls' outcomes kept", exc_info=True)
            return {}
        return {call_id: kept.decode() for call_id, kept in zip(call_ids, found, strict=True) if kept is not None}

    def outcomes_drop(self, call_ids: list[str]) -> None:
        try:
            if call_ids:
                self.client.delete(*[self._outcome_key(call_id) for call_id in call_ids])
        except Exception:  # recorded: the outcome kept finds the call closed, and expires
            logger.warning("could not drop the tool calls' outcomes kept", exc_info=True)

    def async_client(self) -> Any:
        """A new asyncio client, for one reader that follows a job's log with a blocking XREAD."""
        import redis.asyncio as aioredis

        # Its reads block up to a heartbeat's interval (XREAD BLOCK): redis-py's default read timeout
        # (5 s) would cut every stream that is quiet longer, as if Redis had gone.
        timeout = settings.PTC_EVENTS_HEARTBEAT_SECONDS + 10
        return aioredis.Redis.from_url(settings.REDIS_URL, socket_connect_timeout=2, socket_timeout=timeout)


class LocalBackplane(Backplane):
    """The embedded backplane. A job's event log is a file of lines ``<name>\\t<data>\\n``, each
    appended by one ``write`` with ``O_APPEND`` (on a local file system, appends from several
    processes never interleave); an event's id is ``<offset>-0``, the offset just past its line,
    so a reader resumes from it exactly. The log goes with its job's purge, or once its job has
    ended and it was not written for PTC_EVENTS_RETENTION_SECONDS (``events_idle``)."""

    def _subscribe(self, channel: str) -> Subscription:
        return _SocketSubscription(channel)  # listening before it returns

    def _publish(self, channel: str, data: dict[str, Any]) -> None:
        _socket_publish(channel, data)

    def events_append(self, job_call_id: str, events: Events, *, expire: int | None = None) -> None:
        if not events:
            return
        lines = "".join(f"{event}\t{_logged(event, data)}\n" for event, data in events).encode()
        path = _log_path(job_call_id)
        try:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                view = memoryview(lines)
                while view:  # one write but for a full disk: a short write is retried, not left half
                    view = view[os.write(fd, view) :]
            finally:
                os.close(fd)
        except OSError:  # the records stay the truth; a reader rebuilds from them
            logger.warning("could not append events", extra={"job_id": job_call_id}, exc_info=True)
            return
        self.publish(job_channel(job_call_id), Changed())  # wakes its readers

    def events_after(self, job_call_id: str, offset: int) -> tuple[list[tuple[str, str, dict[str, Any]]], int] | None:
        """Return the job's events after ``offset`` (an event's id's first part; 0: from the start)
        whose lines are whole, at most about LOG_READ_BYTES of them, and the offset to read on from;
        None if the job has no log.

        As with a Redis Stream, the events after an offset are those whose ids are greater: an
        offset this log never gave (a Last-Event-ID made up, or another log's) is no line's end,
        and the line it falls in comes whole, never from the middle (its tail read as an event);
        one past the log's end has nothing after it until the log grows past it."""
        try:
            with open(_log_path(job_call_id), "rb") as log:
                if offset > os.fstat(log.fileno()).st_size:
                    return [], offset  # not sought: past the file system's largest file, seek raises
                at = _line_start(log, offset)
                log.seek(at)
                chunk = log.read(LOG_READ_BYTES)
                while chunk and b"\n" not in chunk and (more := log.read(LOG_READ_BYTES)):
                    chunk += more  # one event longer than a read
        except FileNotFoundError:
            return None
        except OSError as exc:  # unreadable (another OS user's, mode 0600): as none, its readers take the records
            logger.warning("could not read a job's event log: %s", exc, extra={"job_id": job_call_id})
            return None
        events = []
        for line in chunk[: chunk.rfind(b"\n") + 1].splitlines(keepends=True):  # a line being written waits
            at += len(line)
            offset = at
            name, _, data = line.rstrip(b"\n").partition(b"\t")
            try:
                events.append((f"{offset}-0", name.decode(), json.loads(data)))
            except ValueError:  # torn (a write cut short, by a full disk): the records tell what it held
                logger.warning("skipped a torn line of a job's event log", extra={"job_id": job_call_id})
        return events, offset

    def _call_end_missing(self, job_call_id: str, call_id: str) -> bool:
        if not _log_path(job_call_id).exists():
            return False
        ends = ("tool_call_end", "tool_call_error")
        return not any(name in ends and data.get("call_id") == call_id for _, name, data in self.events_read(job_call_id))

    def events_end_at(self, job_call_id: str) -> int | None:
        """Return the offset just past the job's ``exec_end`` in its log, or None if it has none."""
        offset = 0
        try:
            with open(_log_path(job_call_id), "rb") as log:
                for line in log:
                    offset += len(line)
                    if line.startswith(b"exec_end\t") and line.endswith(b"\n") and _whole(line):
                        return offset
        except OSError:  # none, or unreadable (events_after)
            pass
        return None

    def events_read(self, job_call_id: str) -> list[tuple[str, str, dict[str, Any]]]:
        events, offset = [], 0
        while (read := self.events_after(job_call_id, offset)) is not None and read[0]:
            events.extend(read[0])
            offset = read[1]
        return events

    def events_drop(self, job_call_ids: list[str]) -> None:
        for job_call_id in job_call_ids:
            _log_path(job_call_id).unlink(missing_ok=True)

    def outcome_keep(self, call_id: str, outcome: str) -> bool:
        path = _outcome_path(call_id)
        try:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False) as kept:
                kept.write(outcome)
            os.replace(kept.name, path)  # whole or not at all
        except OSError:
            logger.warning("could not keep a tool call's outcome", extra={"call_id": call_id}, exc_info=True)
            return False
        return True

    def outcomes_kept(self, call_ids: list[str]) -> dict[str, str]:
        kept = {}
        before = time.time() - OUTCOME_KEPT_SECONDS
        for call_id in call_ids:
            path = _outcome_path(call_id)
            try:
                if path.stat().st_mtime < before:  # expired, as Redis's key would be
                    path.unlink(missing_ok=True)
                else:
                    kept[call_id] = path.read_text()
            except OSError:  # none (nearly always), or unreadable: read again at the next round
                continue
        return kept

    def outcomes_drop(self, call_ids: list[str]) -> None:
        for call_id in call_ids:
            try:
                _outcome_path(call_id).unlink(missing_ok=True)
            except OSError:
                logger.warning("could not drop a tool call's outcome kept", extra={"call_id": call_id}, exc_info=True)

    def events_idle(self, seconds: float) -> list[str]:
        before = time.time() - seconds
        try:
            logs = list(os.scandir(_log_dir()))
        except FileNotFoundError:
            return []
        idle = []
        for entry in logs:
            try:
                if entry.name.endswith(".log") and entry.stat().st_mtime < before:
                    idle.append(entry.name.removesuffix(".log"))
            except FileNotFoundError:  # dropped meanwhile
                continue
        return idle


# What a reader of an embedded log reads at a time.
LOG_READ_BYTES = 1 << 20
# A job's call id as its log's name, as this backplane makes them ("exec_" and hex).
_LOG_NAME = re.compile(r"[A-Za-z0-9_-]{1,100}")


def _whole(line: bytes) -> bool:
    """Return True if ``line`` is an event as appended; False if torn (a write cut short, by a full
    disk, with the next append on after it): its readers skip it (``events_after``)."""
    try:
        json.loads(line.partition(b"\t")[2])
    except ValueError:
        return False
    return True


def _line_start(log: BinaryIO, offset: int) -> int:
    """Return where the line of ``log`` holding the byte before ``offset`` starts: ``offset``
    itself where a line ends there (an event's id), else the start of the line it falls in."""
    end, step = offset, 1  # an event's id, as nearly every one is: the byte before it is a line end
    while end > 0:
        size = min(end, step)
        log.seek(end - size)
        if (newline := log.read(size).rfind(b"\n")) >= 0:
            return end - size + newline + 1
        end, step = end - size, LOG_READ_BYTES >> 4
    return 0


def _log_dir() -> Path:
    return Path(settings.DATA_DIR) / "events"


def _file_name(call_id: str) -> str:
    """``call_id`` as a file's name: never a path of its own making."""
    if _LOG_NAME.fullmatch(call_id) is None:
        return "h" + hashlib.sha256(call_id.encode()).hexdigest()[:40]
    return call_id


def _log_path(job_call_id: str) -> Path:
    return _log_dir() / f"{_file_name(job_call_id)}.log"


def _outcome_path(call_id: str) -> Path:
    return Path(settings.DATA_DIR) / "outcomes" / _file_name(call_id)


@functools.cache
def backplane() -> Backplane:
    """The backplane of this deployment, chosen once: Redis when ``REDIS_URL`` is set."""
    return RedisBackplane() if settings.REDIS_URL else LocalBackplane()
