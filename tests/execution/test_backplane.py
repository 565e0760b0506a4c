"""The backplane's subscriptions on real Redis: one confirmed later receives all that is published
after its confirmation; one Redis never confirms fails, closed, rather than wait in silence."""

import threading
import uuid

import pytest

from execution import backplane as bp
from execution.backplane import Cancel, RedisBackplane


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
