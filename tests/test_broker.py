"""The brokers: the embedded one never hands a consumer a message that is still being written;
on Redis, a consumer takes a burst several messages at a time and loses none of them."""

import threading
import uuid
from pathlib import Path
from typing import Any

import redis
from kombu import Connection, Consumer, Exchange, Producer, Queue

from tests.conftest import REDIS_URL


def test_filesystem_messages_are_whole_or_absent(tmp_path: Path) -> None:
    (tmp_path / "processed").mkdir()
    (tmp_path / "control").mkdir()
    options = {
        "data_folder_in": str(tmp_path),
        "data_folder_out": str(tmp_path),
        "store_processed": False,
        "processed_folder": str(tmp_path / "processed"),
        "control_folder": str(tmp_path / "control"),
        "polling_interval": 0.001,
    }
    transport = "ptcproject.broker:FilesystemTransport"
    count, body = 300, {"payload": "x" * 200_000}  # big enough that a write takes a while
    received: list[dict] = []

    def consume() -> None:
        with Connection(transport=transport, transport_options=options) as conn:
            queue = conn.SimpleQueue("race")
            while len(received) < count:
                message = queue.get(timeout=10)
                received.append(message.payload)
                message.ack()

    # Bound once before the race: kombu keeps bindings per process, so a thread that finds the
    # binding known would publish before the exchange table is written, and to no queue.
    with Connection(transport=transport, transport_options=options) as conn:
        conn.SimpleQueue("race").close()
    consumer = threading.Thread(target=consume)
    consumer.start()
    with Connection(transport=transport, transport_options=options) as conn:
        queue = conn.SimpleQueue("race")
        for _ in range(count):
            queue.put(body)
    consumer.join(30)
    assert len(received) == count
    assert all(message == body for message in received)


def _redis_broker(most: int) -> tuple[Connection, str]:
    prefix = f"ptc-broker-test-{uuid.uuid4().hex[:8]}:"
    options = {"global_keyprefix": prefix, "pop_most": most, "visibility_timeout": 3600}
    return Connection(REDIS_URL, transport="ptcproject.broker:Transport", transport_options=options), prefix


def _publish(conn: Connection, queue: Queue, count: int) -> None:
    with conn.channel() as channel:
        producer = Producer(channel)
        for n in range(count):
            producer.publish({"n": n}, exchange=queue.exchange, routing_key=queue.routing_key, declare=[queue])


def test_redis_consumer_takes_a_burst_at_once_within_its_free_slots() -> None:
    conn, prefix = _redis_broker(most=4)
    queue = Queue("burst", Exchange("burst", type="direct"), routing_key="burst")
    server = redis.Redis.from_url(REDIS_URL)
    received: list[Any] = []
    seen_at_first: dict[str, int] = {}

    def on_message(body: Any, message: Any) -> None:
        if not received:  # the first message handed over: its whole pop is already recorded unacked
            seen_at_first.update(waiting=server.llen(f"{prefix}burst"), unacked=server.hlen(f"{prefix}unacked"))
        received.append((body["n"], message))

    try:
        _publish(conn, queue, 10)
        with conn.channel() as channel:
            channel.basic_qos(0, 3, False)  # three free slots: a pop takes three, not pop_most
            with Consumer(channel, [queue], callbacks=[on_message]):
                while len(received) < 3:
                    conn.drain_events(timeout=5)
                assert seen_at_first == {"waiting": 7, "unacked": 3}
                for _, message in received:
                    message.ack()
                while len(received) < 10:
                    conn.drain_events(timeout=5)
                    for _, message in received[3:]:
                        if not message.acknowledged:
                            message.ack()
        assert [n for n, _ in received] == list(range(10))  # in the order they were sent
        assert server.hlen(f"{prefix}unacked") == 0 and server.zcard(f"{prefix}unacked_index") == 0
    finally:
        conn.release()
        for key in server.scan_iter(f"{prefix}*"):
            server.delete(key)


def test_redis_messages_taken_at_once_go_back_when_their_consumer_stops_before_acking() -> None:
    conn, prefix = _redis_broker(most=16)
    queue = Queue("stop", Exchange("stop", type="direct"), routing_key="stop")
    server = redis.Redis.from_url(REDIS_URL)
    taken: list[int] = []
    try:
        _publish(conn, queue, 6)
        channel = conn.channel()
        channel.basic_qos(0, 4, False)
        with Consumer(channel, [queue], callbacks=[lambda body, message: taken.append(body["n"])]):
            while len(taken) < 4:
                conn.drain_events(timeout=5)
            assert server.llen(f"{prefix}stop") == 2
        channel.close()  # unacked: restored to the queue, as kombu restores a single message
        assert taken == [0, 1, 2, 3]
        assert server.llen(f"{prefix}stop") == 6
        assert server.hlen(f"{prefix}unacked") == 0
        again: list[int] = []
        with (
            conn.channel() as channel,
            Consumer(channel, [queue], callbacks=[lambda body, m: (again.append(body["n"]), m.ack())]),
        ):
            while len(again) < 6:
                conn.drain_events(timeout=5)
        assert sorted(again) == list(range(6))
    finally:
        conn.release()
        for key in server.scan_iter(f"{prefix}*"):
            server.delete(key)
