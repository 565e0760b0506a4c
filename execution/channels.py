"""Pushed messages between processes: a job's channel carries tool results, cancel and its end.

Two implementations behind one small interface (ARCHITECTURE.md):
- Redis pub/sub, when ``REDIS_URL`` is set;
- unix sockets in a directory, for the embedded default that has no server.

A subscriber is a file descriptor that turns readable when messages arrive, so a waiter blocks in
``select``/``epoll`` and is woken by the publisher: no interval polling. A message is delivered to
the subscribers present when it is published; the database stays the source of truth, so a waiter
that misses one still finds the outcome in the record.
"""

import functools
import hashlib
import json
import logging
import os
import queue
import select
import socket
import tempfile
import threading
import uuid
from pathlib import Path
from typing import Any

from django.conf import settings

from tools.sdk_runtime.protocol import FrameDecoder, encode

logger = logging.getLogger("ptc.channels")


def job_channel(call_id: str) -> str:
    """A job's channel: its tool results, cancel, and its end."""
    return f"{settings.PTC_REDIS_PREFIX}ptc:job:{call_id}"


def call_channel(call_id: str) -> str:
    """A standalone call's channel: its result."""
    return f"{settings.PTC_REDIS_PREFIX}ptc:call:{call_id}"


class Subscription:
    """Messages of one channel, queued by a reader thread; ``fileno()`` is readable while any wait."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._closed = threading.Event()

    def fileno(self) -> int:
        return self._wake_r

    def _put(self, message: dict[str, Any]) -> None:
        self._queue.put(message)
        try:
            os.write(self._wake_w, b"\0")
        except OSError:
            pass

    def drain(self) -> list[dict[str, Any]]:
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
        select.select([self._wake_r], [], [], max(0.0, timeout))

    def close(self) -> None:
        if not self._closed.is_set():
            self._closed.set()
            self._stop()
            os.close(self._wake_r)
            os.close(self._wake_w)

    def _stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> "Subscription":
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


# -- Redis ---------------------------------------------------------------------------------------
@functools.cache
def redis_client() -> Any:
    import redis

    # A Redis that is down is known in seconds, not after the OS's TCP timeout.
    return redis.Redis.from_url(settings.REDIS_URL, health_check_interval=30, socket_keepalive=True, socket_connect_timeout=2)


class _RedisSubscription(Subscription):
    def __init__(self, channel: str) -> None:
        super().__init__()
        self._pubsub = redis_client().pubsub(ignore_subscribe_messages=True)
        self._pubsub.subscribe(channel)  # subscribed before it returns: nothing published after is missed
        self._thread = threading.Thread(target=self._listen, name=f"sub-{channel}", daemon=True)
        self._thread.start()

    def _listen(self) -> None:
        broken = False
        while not self._closed.is_set():
            try:
                message = self._pubsub.get_message(timeout=1.0)  # blocks on the socket; wakes on a push
            except Exception:  # Redis went away; redis-py resubscribes when it reconnects
                broken = True
                if self._closed.wait(0.5):
                    return
                continue
            if broken:
                broken = False
                self._put({"kind": "resync"})  # what was pushed meanwhile is lost: look at the records
            if message and message.get("type") == "message":
                self._put(json.loads(message["data"]))

    def _stop(self) -> None:
        try:
            self._pubsub.close()
        except Exception:  # closing a broken connection must not raise out of cleanup
            pass


# -- Embedded: unix sockets ----------------------------------------------------------------------
def _socket_dir(channel: str) -> Path:
    # Unix socket paths are limited to 108 bytes: keep them short and under the temp dir.
    base = hashlib.sha256(str(settings.DATA_DIR).encode()).hexdigest()[:10]
    return Path(tempfile.gettempdir()) / f"ptc-ch-{base}" / hashlib.sha256(channel.encode()).hexdigest()[:20]


class _SocketSubscription(Subscription):
    def __init__(self, channel: str) -> None:
        super().__init__()
        directory = _socket_dir(channel)
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._path = directory / f"{uuid.uuid4().hex[:12]}.sock"
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(str(self._path))
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
                        self._put(message)

    def _stop(self) -> None:
        try:
            self._path.unlink()
        except FileNotFoundError:
            pass
        self._server.close()


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
        except OSError:
            continue


# -- The interface -------------------------------------------------------------------------------
def subscribe(channel: str) -> Subscription:
    """Start receiving ``channel``'s messages. Close the subscription when done."""
    return _RedisSubscription(channel) if settings.REDIS_URL else _SocketSubscription(channel)


def publish(channel: str, message: dict[str, Any]) -> bool:
    """Push ``message`` to everyone subscribed to ``channel`` now. Return False if it could not be
    sent (Redis unreachable): never raises, since every push has a fallback on the records (a
    subscriber resyncs after a reconnect, a call past its deadline is looked up, a running job's
    heartbeat finds it cancelled, ``wait`` times out and reads the job)."""
    try:
        if settings.REDIS_URL:
            redis_client().publish(channel, json.dumps(message, separators=(",", ":")))
        else:
            _socket_publish(channel, message)
    except Exception:  # see above: the records stay the truth
        logger.warning("could not publish on %s", channel, exc_info=True)
        return False
    return True
