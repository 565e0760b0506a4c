"""The brokers: the embedded one never hands a consumer a message that is still being written;
on Redis, a consumer takes a burst several messages at a time and loses none of them."""

import threading
import uuid
from pathlib import Path
from typing import Any

import pytest
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


def test_redis_messages_consumed_without_acks_leave_no_unacked_record() -> None:
    """Celery's replies (pidbox, mingle) are consumed without acks: a multi-pop records nothing for
    them, or each would be "restored" an hour later into a reply queue nobody reads."""
    conn, prefix = _redis_broker(most=16)
    queue = Queue("replies", Exchange("replies", type="direct"), routing_key="replies", no_ack=True)
    server = redis.Redis.from_url(REDIS_URL)
    got: list[int] = []
    try:
        _publish(conn, queue, 5)
        with (
            conn.channel() as channel,
            Consumer(channel, [queue], no_ack=True, callbacks=[lambda body, m: got.append(body["n"])]),
        ):
            while len(got) < 5:
                conn.drain_events(timeout=5)
        assert got == list(range(5))
        assert server.hlen(f"{prefix}unacked") == 0 and server.zcard(f"{prefix}unacked_index") == 0
    finally:
        conn.release()
        for key in server.scan_iter(f"{prefix}*"):
            server.delete(key)


def test_redis_a_malformed_message_costs_no_other_message_of_its_pop() -> None:
    conn, prefix = _redis_broker(most=16)
    queue = Queue("mixed", Exchange("mixed", type="direct"), routing_key="mixed")
    server = redis.Redis.from_url(REDIS_URL)
    got: list[int] = []
    try:
        _publish(conn, queue, 2)
        server.lpush(f"{prefix}mixed", b"not json", b'{"properties": {}}')  # behind the two, in the same pop
        _publish(conn, queue, 1)
        with conn.channel() as channel, Consumer(channel, [queue], callbacks=[lambda body, m: (got.append(body["n"]), m.ack())]):
            while len(got) < 3:
                conn.drain_events(timeout=5)
        assert got == [0, 1, 0]
        assert server.llen(f"{prefix}mixed") == 0 and server.hlen(f"{prefix}unacked") == 0
    finally:
        conn.release()
        for key in server.scan_iter(f"{prefix}*"):
            server.delete(key)


def test_redis_a_server_that_refuses_info_is_consumed_one_message_at_a_time() -> None:
    """An ACL without @dangerous (a common one for Celery) refuses INFO: the consumer takes kombu's
    BRPOP, one message at a time, rather than failing."""
    server = redis.Redis.from_url(REDIS_URL)
    user, password = f"ptc-test-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    server.acl_setuser(
        user, enabled=True, passwords=[f"+{password}"], keys=["*"], channels=["*"], commands=["+@all", "-@dangerous"]
    )
    prefix = f"ptc-broker-test-{uuid.uuid4().hex[:8]}:"
    url = REDIS_URL.replace("redis://", f"redis://{user}:{password}@", 1)
    conn = Connection(
        url, transport="ptcproject.broker:Transport", transport_options={"global_keyprefix": prefix, "pop_most": 16}
    )
    queue = Queue("acl", Exchange("acl", type="direct"), routing_key="acl")
    got: list[int] = []
    try:
        _publish(conn, queue, 3)
        with conn.channel() as channel, Consumer(channel, [queue], callbacks=[lambda body, m: (got.append(body["n"]), m.ack())]):
            while len(got) < 3:
                conn.drain_events(timeout=5)
            assert channel._multi_pop is False
        assert got == [0, 1, 2]
    finally:
        conn.release()
        server.acl_deluser(user)
        for key in server.scan_iter(f"{prefix}*"):
            server.delete(key)


def test_only_tools_workers_take_several_messages_at_once() -> None:
    from types import SimpleNamespace

    from ptcproject.celery import _fit_worker_to_queue

    for queues, most in ((["exec"], 1), (["tools"], 16), (["exec", "tools"], 1)):
        conf = SimpleNamespace(worker_concurrency=4, broker_transport_options={"pop_most": 16}, worker_send_task_events=True)
        _fit_worker_to_queue(conf=conf, options={"queues": queues})
        assert conf.broker_transport_options["pop_most"] == most, queues


def test_redis_messages_of_a_pop_not_handed_over_go_back_at_once_when_one_fails() -> None:
    conn, prefix = _redis_broker(most=16)
    queue = Queue("fails", Exchange("fails", type="direct"), routing_key="fails")
    server = redis.Redis.from_url(REDIS_URL)
    got: list[int] = []

    def on_message(body: Any, message: Any) -> None:
        got.append(body["n"])
        if body["n"] == 1:
            raise RuntimeError("the consumer failed on this one")

    try:
        _publish(conn, queue, 5)
        channel = conn.channel()
        with Consumer(channel, [queue], callbacks=[on_message]):
            with pytest.raises(RuntimeError):
                conn.drain_events(timeout=5)
            assert got == [0, 1]
            # The three never handed over are back at the head of the queue, in order, now; the
            # two handed over stay unacked with their consumer.
            assert server.llen(f"{prefix}fails") == 3 and server.hlen(f"{prefix}unacked") == 2
            while len(got) < 5:
                conn.drain_events(timeout=5)
        assert got == [0, 1, 2, 3, 4]
    finally:
        conn.release()
        for key in server.scan_iter(f"{prefix}*"):
            server.delete(key)
