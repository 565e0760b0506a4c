"""The backplane's subscriptions on real Redis: one confirmed later receives all that is published
after its confirmation; one Redis never confirms fails, closed, rather than wait in silence; a
direct one (a running job's) is read from a connection of its own, and through the hub once that
connection is lost."""

import os
import select
import socket
import stat
import threading
import time
import uuid

import pytest
import redis
from django.conf import settings

from execution import backplane as bp
from execution.backplane import Approved, Cancel, RedisBackplane, Resync


def test_a_subscription_confirmed_later_receives_what_is_published_after() -> None:
    plane = RedisBackplane()
    channel = f"ptc-test:{uuid.uuid4().hex}"
    with plane.subscribe(channel, confirmed=False) as subscription:
        subscription.confirm()  # meanwhile the caller did its own work
        assert plane.publish(channel, Cancel())
        subscription.wait(5)
        assert [type(message) for message in subscription.drain()] == [Cancel]


def test_a_subscription_never_confirmed_fails_and_is_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    plane = RedisBackplane()
    monkeypatch.setattr(bp, "SUBSCRIBE_TIMEOUT", 0.2)
    # Redis takes the SUBSCRIBE, but its confirmation never comes back.
    monkeypatch.setattr(bp._RedisHub, "add", lambda self, subscription: threading.Event())
    subscription = plane.subscribe(f"ptc-test:{uuid.uuid4().hex}", confirmed=False)
    with pytest.raises(TimeoutError, match="did not confirm"):
        subscription.confirm()
    assert subscription._closed.is_set()
    with pytest.raises(TimeoutError):
        plane.subscribe(f"ptc-test:{uuid.uuid4().hex}")  # confirmed by default: it raises at once


def test_a_subscription_nobody_drains_still_closes() -> None:
    # A reader thread keeps putting messages nobody drains; the owner then closes: neither waits
    # for the other (a put holds the subscription's lock while it wakes the owner).
    class Plain(bp.Subscription):
        def _stop(self) -> None:
            pass

    subscription = Plain()
    putter = threading.Thread(target=lambda: [subscription._put(Cancel()) for _ in range(70_000)], daemon=True)
    putter.start()
    putter.join(20)
    assert not putter.is_alive(), "a put blocked on a full wake-up pipe"
    closer = threading.Thread(target=subscription.close, daemon=True)
    closer.start()
    closer.join(5)
    assert not closer.is_alive()
    subscription._put(Cancel())  # after the close: dropped, not written to a closed pipe


def test_the_reader_does_not_sleep_when_its_wait_times_out(monkeypatch: pytest.MonkeyPatch) -> None:
    # Between subscriptions the reader waits on its connection, READ_TIMEOUT at a time. It used to
    # sleep 50 ms after each wait that timed out, and a SUBSCRIBE sent meanwhile waited that long
    # for its confirmation: a request after a quiet second was up to 50 ms late, one in twenty.
    monkeypatch.setattr(bp, "READ_TIMEOUT", 0.01)
    slept: list[float] = []
    real_sleep = bp.time.sleep
    monkeypatch.setattr(bp.time, "sleep", lambda seconds: (slept.append(seconds), real_sleep(seconds)))
    plane = RedisBackplane()
    with plane.subscribe(f"ptc-test:{uuid.uuid4().hex}"):
        pass
    real_sleep(0.3)  # about 30 waits with nothing subscribed, each timing out
    assert slept == []


def _taken(subscription: bp.Subscription, until: type, seconds: float = 10.0) -> list[type]:
    """The kinds of message ``subscription`` gives, waiting on its ``fileno()`` as a job's selector
    does (taking it anew after each drain), until one is ``until`` or ``seconds`` pass."""
    deadline = time.monotonic() + seconds
    kinds: list[type] = []
    while until not in kinds and time.monotonic() < deadline:
        select.select([subscription.fileno()], [], [], max(0.0, deadline - time.monotonic()))
        kinds += [type(message) for message in subscription.drain()]
    return kinds


def test_a_direct_subscription_is_read_from_its_own_connection_kept_for_the_next_one() -> None:
    # A running job's channel (its tool results) is read by the job's own thread from a connection
    # of its own, with no hand-off from the hub's reader; the connection is kept for the next job's,
    # which never sees the last one's messages.
    plane = RedisBackplane()
    first, second = f"ptc-test:{uuid.uuid4().hex}", f"ptc-test:{uuid.uuid4().hex}"
    with plane.subscribe_direct(first) as subscription:
        subscription.confirm()
        assert stat.S_ISSOCK(os.fstat(subscription.fileno()).st_mode)  # Redis's socket, not the hub's pipe
        assert plane.publish(first, Cancel())
        assert _taken(subscription, Cancel) == [Cancel]
        kept = subscription._pubsub  # type: ignore[attr-defined]
    assert plane.publish(first, Cancel())  # after its close
    with plane.subscribe_direct(second) as again:
        assert again._pubsub is kept  # type: ignore[attr-defined]
        again.confirm()
        assert plane.publish(second, Approved(call_id="c", timeout=1.0))
        assert _taken(again, Approved) == [Approved]


def test_a_direct_subscription_whose_connection_is_lost_goes_on_through_the_hub_after_a_resync() -> None:
    plane = RedisBackplane()
    channel = f"ptc-test:{uuid.uuid4().hex}"
    with plane.subscribe_direct(channel) as subscription:
        subscription.confirm()
        own = subscription.fileno()
        port = subscription._sock.getsockname()[1]  # type: ignore[attr-defined]
        with redis.Redis.from_url(settings.REDIS_URL) as client:  # closed from Redis's side, as a blip of the network
            [found] = [c["id"] for c in client.client_list() if c["addr"].endswith(f":{port}")]
            client.client_kill_filter(_id=found)
        # Woken by the lost connection; told to look at the records once the hub has the channel.
        assert _taken(subscription, Resync) == [Resync]
        assert subscription.fileno() != own
        assert plane.publish(channel, Cancel())
        assert _taken(subscription, Cancel) == [Cancel]


def test_a_direct_subscriptions_connection_lost_while_kept_is_not_given_to_the_next(caplog: pytest.LogCaptureFixture) -> None:
    # A kept connection that Redis closed while it was idle (its `timeout` for idle clients, which
    # spares only those subscribed; a restart) was handed to the next job, whose subscription was
    # sent down it and lost: every such job took the hub's path, its records read again (a Resync).
    plane = RedisBackplane()
    first, second = f"ptc-test:{uuid.uuid4().hex}", f"ptc-test:{uuid.uuid4().hex}"
    with plane.subscribe_direct(first) as subscription:
        subscription.confirm()
        kept = subscription._pubsub  # type: ignore[attr-defined]
        port = subscription._sock.getsockname()[1]  # type: ignore[attr-defined]
    with redis.Redis.from_url(settings.REDIS_URL) as client:
        deadline = time.monotonic() + 10
        while kept.subscribed:  # its unsubscribe answered: the connection idle, as it is between jobs
            assert time.monotonic() < deadline, "Redis did not answer the unsubscribe"
            kept.get_message(timeout=0.1)
        [found] = [c["id"] for c in client.client_list() if c["addr"].endswith(f":{port}")]
        client.client_kill_filter(_id=found)
        while any(c["addr"].endswith(f":{port}") for c in client.client_list()):
            assert time.monotonic() < deadline, "Redis did not close the connection"
            time.sleep(0.05)
    with caplog.at_level("WARNING", logger="ptc.backplane"), plane.subscribe_direct(second) as again:
        assert again._pubsub is not kept  # type: ignore[attr-defined]
        again.confirm()
        own = again.fileno()
        assert stat.S_ISSOCK(os.fstat(own).st_mode)
        assert plane.publish(second, Cancel())
        assert _taken(again, Cancel) == [Cancel]
        assert again.fileno() == own  # read from its own connection all along
    assert not [r for r in caplog.records if "own connection failed" in r.getMessage()]


class _StallingProxy:
    """A TCP proxy to Redis that can stall one client's connection in the middle of a reply: of the
    next bytes Redis sends it, the first few are passed on and the rest held (a network that stops
    mid-message)."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.stalled: set[int] = set()  # the client ports whose next reply stalls
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, (_, port) = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            self.sockets += [client, server]
            threading.Thread(target=self._pump, args=(client, server, None), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, port), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, port: int | None) -> None:
        try:
            while chunk := source.recv(65536):
                if port in self.stalled:
                    sink.sendall(chunk[:3])
                    return  # the rest never comes
                sink.sendall(chunk)
        except OSError:
            pass

    def close(self) -> None:
        self.listener.close()
        for sock in self.sockets:
            sock.close()


def test_a_direct_subscription_whose_connection_stalls_mid_reply_goes_on_through_the_hub(monkeypatch: pytest.MonkeyPatch) -> None:
    # A reply cut off in the middle (the network stops mid-message) must not hold the job's own
    # thread in a read of the rest until TCP's keepalive gives up (hours): the job's own timeout,
    # its cancel, its calls' results would all wait on it. redis-py's read of a message it has the
    # start of times out ("Timeout reading from socket"), and the channel is followed through the
    # hub, after a Resync.
    url = redis.connection.parse_url(settings.REDIS_URL)
    proxy = _StallingProxy((url.get("host", "127.0.0.1"), url.get("port", 6379)))
    monkeypatch.setattr(settings, "REDIS_URL", f"redis://127.0.0.1:{proxy.port}/{url.get('db', 0)}")
    plane = RedisBackplane()
    channel = f"ptc-test:{uuid.uuid4().hex}"
    kinds: list[type] = []
    try:
        with plane.subscribe_direct(channel) as subscription:
            subscription.confirm()
            proxy.stalled.add(subscription._sock.getsockname()[1])  # type: ignore[attr-defined]
            assert plane.publish(channel, Cancel())
            reader = threading.Thread(target=lambda: kinds.extend(_taken(subscription, Resync, seconds=30)), daemon=True)
            reader.start()
            reader.join(30)
            assert not reader.is_alive(), "the job's thread is stuck reading a reply cut off in the middle"
            assert kinds[-1:] == [Resync], kinds
            assert plane.publish(channel, Cancel())
            assert _taken(subscription, Cancel) == [Cancel]
    finally:
        proxy.close()
