"""The brokers: the embedded one never hands a consumer a message that is still being written;
on Redis, a consumer takes a burst several messages at a time and loses none of them."""

import logging
import os
import shlex
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from kombu import Connection, Consumer, Exchange, Producer, Queue

from tests.conftest import REDIS_PREFIX, REDIS_URL
from tests.servers import RedisServer
from tests.stack import BIN, Process


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


def test_a_queue_bound_to_an_exchange_table_being_written_waits_for_it(tmp_path: Path) -> None:
    # kombu creates a table empty, then locks and writes it: a second worker binding its queue in
    # between read the empty file and died (the quickstart's exec and tools workers start at once).
    control = tmp_path / "control"
    control.mkdir()
    table = control / "race.exchange"
    table.write_bytes(b"")
    options = {"data_folder_in": str(tmp_path), "data_folder_out": str(tmp_path), "control_folder": str(control)}

    def written() -> None:
        table.write_text('[["first", "", "first"]]')

    writer = threading.Timer(0.1, written)
    writer.start()
    with Connection(transport="ptcproject.broker:FilesystemTransport", transport_options=options) as conn:
        channel = conn.channel()
        channel._queue_bind("race", "second", "", "second")
        bound = {entry.queue for entry in channel.get_table("race")}
    writer.join()
    assert bound == {"first", "second"}


@dataclass
class _Broker:
    """A queue on our Redis transport, under a prefix of its own, and Redis itself to look in."""

    conn: Connection
    queue: Queue
    server: redis.Redis
    prefix: str

    def publish(self, count: int) -> None:
        """Send ``{"n": 0}`` .. ``{"n": count - 1}``, in that order."""
        with self.conn.channel() as channel:
            producer = Producer(channel)
            for n in range(count):
                producer.publish({"n": n}, exchange=self.queue.exchange, routing_key=self.queue.routing_key, declare=[self.queue])

    def waiting(self) -> int:
        return self.server.llen(f"{self.prefix}{self.queue.name}")

    def unacked(self) -> int:
        return self.server.hlen(f"{self.prefix}unacked")

    def drain(self, until: Callable[[], bool]) -> None:
        while not until():
            self.conn.drain_events(timeout=5)


@contextmanager
def _redis_queue(
    name: str, *, most: int, url: str = REDIS_URL, no_ack: bool = False, expires: float | None = None, **options: Any
) -> Iterator[_Broker]:
    """A queue named ``name`` on our Redis transport at ``url``; one that ``expires`` (seconds unused)
    as Celery's pidbox, gossip and reply queues do."""
    prefix = f"ptc-broker-test-{uuid.uuid4().hex[:8]}:"
    options.update(global_keyprefix=prefix, pop_most=most, visibility_timeout=3600)
    conn = Connection(url, transport="ptcproject.broker:Transport", transport_options=options)
    server = redis.Redis.from_url(url)
    queue = Queue(name, Exchange(name, type="direct"), routing_key=name, no_ack=no_ack, expires=expires)
    try:
        yield _Broker(conn, queue, server, prefix)
    finally:
        conn.release()
        for key in server.scan_iter(f"{prefix}*"):
            server.delete(key)


def _acking(got: list[int]) -> Callable[[Any, Any], None]:
    """A consumer callback that keeps each message's number and acks it."""

    def on_message(body: Any, message: Any) -> None:
        got.append(body["n"])
        message.ack()

    return on_message


def test_redis_consumer_takes_a_burst_at_once_within_its_free_slots() -> None:
    with _redis_queue("burst", most=4) as broker:
        received: list[Any] = []
        seen_at_first: dict[str, int] = {}

        def on_message(body: Any, message: Any) -> None:
            if not received:  # the first message handed over: its whole pop is off the queue
                seen_at_first.update(waiting=broker.waiting())
            received.append((body["n"], message))

        broker.publish(10)
        with broker.conn.channel() as channel:
            channel.basic_qos(0, 3, False)  # three free slots: a pop takes three, not pop_most
            with Consumer(channel, [broker.queue], callbacks=[on_message]):
                broker.drain(lambda: len(received) >= 3)
                assert seen_at_first == {"waiting": 7}
                assert broker.unacked() == 3  # the pop's records, written once its messages were handed over
                for _, message in received:
                    message.ack()
                while len(received) < 10:
                    broker.conn.drain_events(timeout=5)
                    for _, message in received[3:]:
                        if not message.acknowledged:
                            message.ack()
        assert [n for n, _ in received] == list(range(10))  # in the order they were sent
        assert broker.unacked() == 0 and broker.server.zcard(f"{broker.prefix}unacked_index") == 0


@pytest.mark.parametrize("thread", ["consumer", "another"])
def test_redis_a_pops_messages_are_handed_over_before_their_record_and_an_ack_before_it_waits_for_it(thread: str) -> None:
    """A pop's messages are handed over first and recorded unacked after, in one round trip (a task
    starts without waiting for it); an ack that comes before the record, on the consumer's thread or
    another, goes to Redis after it: a record written after its ack would outlive it, and its
    message be restored and run again."""
    with _redis_queue("early-ack", most=4) as broker:
        got: list[int] = []
        unacked_when_handed: list[int] = []

        def on_message(body: Any, message: Any) -> None:
            unacked_when_handed.append(broker.unacked())
            if thread == "consumer":
                message.ack()
            else:
                acker = threading.Thread(target=message.ack)
                acker.start()
                acker.join()
            got.append(body["n"])

        broker.publish(4)
        with broker.conn.channel() as channel:
            channel.basic_qos(0, 4, False)
            with Consumer(channel, [broker.queue], callbacks=[on_message]):
                broker.drain(lambda: len(got) >= 4)
                assert got == [0, 1, 2, 3]
                assert unacked_when_handed == [0, 0, 0, 0]  # one pop, handed over before its record
                assert broker.unacked() == 0 and broker.server.zcard(f"{broker.prefix}unacked_index") == 0


def test_redis_a_message_requeued_before_its_pops_record_goes_back_at_once_and_leaves_no_record() -> None:
    """Requeued as it is handed over, before its pop's record is written (Redis has none to restore
    it from yet), a message goes back to its queue from memory and is taken again at once; its
    record, written after, is deleted with it, never restored an hour later."""
    with _redis_queue("early-requeue", most=4) as broker:
        seen: list[tuple[int, bool]] = []

        def on_message(body: Any, message: Any) -> None:
            seen.append((body["n"], bool(message.delivery_info.get("redelivered"))))
            if len(seen) == 1:
                message.requeue()
            else:
                message.ack()

        broker.publish(1)
        with broker.conn.channel() as channel:
            with Consumer(channel, [broker.queue], callbacks=[on_message]):
                broker.drain(lambda: len(seen) >= 2)
                assert [n for n, _ in seen] == [0, 0]
                assert broker.waiting() == 0
                assert broker.unacked() == 0 and broker.server.zcard(f"{broker.prefix}unacked_index") == 0


def test_redis_messages_taken_at_once_go_back_when_their_consumer_stops_before_acking() -> None:
    with _redis_queue("stop", most=16) as broker:
        taken: list[int] = []
        broker.publish(6)
        channel = broker.conn.channel()
        channel.basic_qos(0, 4, False)
        with Consumer(channel, [broker.queue], callbacks=[lambda body, message: taken.append(body["n"])]):
            broker.drain(lambda: len(taken) >= 4)
            assert broker.waiting() == 2
        channel.close()  # unacked: restored to the queue, as kombu restores a single message
        assert taken == [0, 1, 2, 3]
        assert broker.waiting() == 6
        assert broker.unacked() == 0
        again: list[int] = []
        with broker.conn.channel() as channel, Consumer(channel, [broker.queue], callbacks=[_acking(again)]):
            broker.drain(lambda: len(again) >= 6)
        assert sorted(again) == list(range(6))


def test_redis_messages_consumed_without_acks_leave_no_unacked_record() -> None:
    """Celery's replies (pidbox, mingle) are consumed without acks: a multi-pop records nothing for
    them, or each would be "restored" an hour later into a reply queue nobody reads."""
    with _redis_queue("replies", most=16, no_ack=True) as broker:
        got: list[int] = []
        broker.publish(5)
        callbacks = [lambda body, m: got.append(body["n"])]
        with broker.conn.channel() as channel, Consumer(channel, [broker.queue], no_ack=True, callbacks=callbacks):
            broker.drain(lambda: len(got) >= 5)
        assert got == list(range(5))
        assert broker.unacked() == 0 and broker.server.zcard(f"{broker.prefix}unacked_index") == 0


def test_redis_a_malformed_message_costs_no_other_message_of_its_pop() -> None:
    with _redis_queue("mixed", most=16) as broker:
        got: list[int] = []
        broker.publish(2)
        broker.server.lpush(f"{broker.prefix}mixed", b"not json", b'{"properties": {}}')  # behind the two, in the same pop
        broker.publish(1)
        with broker.conn.channel() as channel, Consumer(channel, [broker.queue], callbacks=[_acking(got)]):
            broker.drain(lambda: len(got) >= 3)
        assert got == [0, 1, 0]
        assert broker.waiting() == 0 and broker.unacked() == 0


def test_redis_a_server_that_refuses_info_is_consumed_one_message_at_a_time() -> None:
    """An ACL without @dangerous (a common one for Celery) refuses INFO: the consumer takes kombu's
    BRPOP, one message at a time, rather than failing."""
    server = redis.Redis.from_url(REDIS_URL)
    user, password = f"ptc-test-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    server.acl_setuser(
        user, enabled=True, passwords=[f"+{password}"], keys=["*"], channels=["*"], commands=["+@all", "-@dangerous"]
    )
    try:
        with _redis_queue("acl", most=16, url=REDIS_URL.replace("redis://", f"redis://{user}:{password}@", 1)) as broker:
            got: list[int] = []
            broker.publish(3)
            with broker.conn.channel() as channel, Consumer(channel, [broker.queue], callbacks=[_acking(got)]):
                broker.drain(lambda: len(got) >= 3)
                assert channel._multi_pop is False
            assert got == [0, 1, 2]
    finally:
        server.acl_deluser(user)


@pytest.mark.parametrize("policy", ["allkeys-lru", "volatile-lru", "noeviction"])
def test_a_consumer_warns_when_its_redis_may_evict_the_queues(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, policy: str
) -> None:
    """Redis with a maxmemory and an allkeys-* policy drops queued messages once full: each a job or
    a tool call gone without an error anywhere. A worker says so as it starts consuming."""
    server = RedisServer(tmp_path)
    server.start()
    try:
        redis.Redis.from_url(server.url).config_set("maxmemory", "64mb")
        redis.Redis.from_url(server.url).config_set("maxmemory-policy", policy)
        with caplog.at_level("WARNING", logger="ptc.broker"), _redis_queue("evict", most=16, url=server.url) as broker:
            got: list[int] = []
            broker.publish(2)
            with broker.conn.channel() as channel, Consumer(channel, [broker.queue], callbacks=[_acking(got)]):
                broker.drain(lambda: len(got) >= 2)
    finally:
        server.stop()
    said = [record.getMessage() for record in caplog.records if record.name == "ptc.broker"]
    if policy.startswith("allkeys-"):
        assert len(said) == 1 and said[0].startswith("the broker's Redis has maxmemory-policy allkeys-lru: once full"), said
    else:  # volatile-*: only keys that expire, which no queue does
        assert said == []


@pytest.mark.parametrize("most", [16, 1])
def test_redis_messages_taken_while_it_is_full_are_handed_over_not_lost(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, most: int
) -> None:
    """A full Redis (maxmemory, noeviction) serves a pop but refuses the unacked record after it (and
    would refuse the message back): the consumer raised, the messages it took were gone, and a
    worker died of it. Each is handed over (BLMPOP's several, and kombu's BRPOP's one), and acked."""
    server = RedisServer(tmp_path)
    server.start()
    try:
        with _redis_queue("full", most=most, url=server.url) as broker:
            got: list[int] = []
            broker.publish(3)
            with broker.conn.channel() as channel, Consumer(channel, [broker.queue], callbacks=[_acking(got)]):
                broker.server.config_set("maxmemory", "1")
                try:
                    with caplog.at_level("WARNING", logger="ptc.broker"):
                        broker.drain(lambda: len(got) >= 3)
                finally:
                    broker.server.config_set("maxmemory", "0")
            assert got == [0, 1, 2]
            assert broker.waiting() == 0 and broker.unacked() == 0
    finally:
        server.stop()
    said = [record.getMessage() for record in caplog.records if record.name == "ptc.broker"]
    assert said and all(line.startswith("Redis is full (its maxmemory): ") for line in said), said


def _binding_refresh(transport: Any, caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    """The WARNING log records of one refresh of the bindings of ``transport``'s consumers, as a
    worker's loop makes it."""
    caplog.clear()
    for channel in transport.channels:
        channel._binding_expiry_refreshed_at = float("-inf")  # due now
    transport.cycle.maybe_refresh_binding_expiry()  # kombu calls it so each second
    return [record for record in caplog.records if record.levelno >= logging.WARNING]


FULL = "the broker is full (Redis has reached its maxmemory): "


def test_a_binding_refresh_a_full_redis_refuses_is_one_line_in_the_log(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """kombu refreshes the bindings of the expiring queues a worker consumes (Celery's pidbox, gossip
    and reply queues) each second with a script, which a full Redis refuses: each refusal was a
    WARNING with two chained tracebacks, 60 lines. It is one line that says so; any other error
    Redis answers is kombu's WARNING still, traceback and all."""
    server = RedisServer(tmp_path)
    server.start()
    user, password = "ptc-refresh", uuid.uuid4().hex
    admin = redis.Redis.from_url(server.url)
    admin.acl_setuser(user, enabled=True, passwords=[f"+{password}"], keys=["*"], channels=["*"], commands=["+@all"])
    url = server.url.replace("redis://", f"redis://{user}:{password}@", 1)
    try:
        with caplog.at_level("WARNING"), _redis_queue("refresh", most=16, url=url, expires=60) as broker:
            transport = broker.conn.transport
            with broker.conn.channel() as channel, Consumer(channel, [broker.queue], callbacks=[_acking([])]):
                assert _binding_refresh(transport, caplog) == []
                admin.config_set("maxmemory", "1")
                try:
                    [full] = _binding_refresh(transport, caplog)
                finally:
                    admin.config_set("maxmemory", "0")
                assert full.name == "ptc.broker" and full.exc_info is None, full
                assert full.getMessage() == (
                    f"{FULL}the bindings of queues refresh are not refreshed (kombu tries again every second; "
                    "said again at most every 60 s while it goes on)"
                )
                assert [record.getMessage() for record in _binding_refresh(transport, caplog)] == [
                    "the broker has room again: the bindings of queues refresh are refreshed again (1 refused over 0 s)"
                ]
                admin.acl_setuser(user, enabled=True, commands=["-evalsha"])  # refused for another reason
                [other] = _binding_refresh(transport, caplog)
                assert other.name == "kombu.transport.redis" and other.exc_info is not None, other
    finally:
        server.stop()


def test_a_full_redis_refusing_binding_refreshes_for_long_is_said_once_a_minute_and_when_it_ends(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each refusal was a line, every second: an hour of a full Redis wrote 3,600 of them a worker.
    They are said as they begin, then at most once a minute with how many were refused since, and
    once as a refresh goes through again. The process's clock is moved on, not waited for."""
    from ptcproject import broker as transport_module

    ahead = [0.0]
    monkeypatch.setattr(transport_module, "monotonic", lambda: time.monotonic() + ahead[0])
    server = RedisServer(tmp_path)
    server.start()
    admin = redis.Redis.from_url(server.url)
    try:
        with caplog.at_level("WARNING"), _redis_queue("refresh", most=16, url=server.url, expires=60) as broker:
            transport = broker.conn.transport
            with broker.conn.channel() as channel, Consumer(channel, [broker.queue], callbacks=[_acking([])]):
                admin.config_set("maxmemory", "1")
                try:
                    said = [record.getMessage() for _ in range(20) for record in _binding_refresh(transport, caplog)]
                    assert said == [
                        f"{FULL}the bindings of queues refresh are not refreshed (kombu tries again every second; "
                        "said again at most every 60 s while it goes on)"
                    ]
                    ahead[0] += 61
                    said = [record.getMessage() for _ in range(20) for record in _binding_refresh(transport, caplog)]
                    assert said == [f"{FULL}the bindings of queues refresh are still not refreshed (20 refused in the last 61 s)"]
                finally:
                    admin.config_set("maxmemory", "0")
                said = [record.getMessage() for _ in range(3) for record in _binding_refresh(transport, caplog)]
                assert said == [
                    "the broker has room again: the bindings of queues refresh are refreshed again (40 refused over 61 s)"
                ]
    finally:
        server.stop()


def test_acks_in_the_event_loop_go_to_redis_together_at_the_end_of_its_turn() -> None:
    from kombu.asynchronous import Hub

    with _redis_queue("turn", most=16) as broker:
        received: list[Any] = []
        broker.publish(5)
        with broker.conn.channel() as channel, Consumer(channel, [broker.queue], callbacks=[lambda _, m: received.append(m)]):
            broker.drain(lambda: len(received) >= 5)
            assert broker.unacked() == 5
            transport = broker.conn.transport
            # Outside an event loop (none registered yet), an ack goes at once, as kombu's does.
            received[0].ack()
            assert broker.unacked() == 4
            transport._loop_thread = threading.get_ident()  # as registering with a loop (below) sets it
            for message in received[1:]:
                message.ack()
            assert broker.unacked() == 4  # held until the turn ends
            transport._acks_flush()
            assert broker.unacked() == 0 and broker.waiting() == 0

    # A worker's loop ends every turn with the flush; its acks from other threads go at once.
    with _redis_queue("loop", most=16) as broker:
        hub = Hub()
        try:
            transport = broker.conn.transport
            transport.register_with_event_loop(broker.conn.connection, hub)
            assert transport._acks_flush in hub.on_tick and transport.in_loop()
            elsewhere: list[bool] = []
            other = threading.Thread(target=lambda: elsewhere.append(transport.in_loop()))
            other.start()
            other.join()
            assert elsewhere == [False]
        finally:
            hub.close()


def test_only_tools_workers_take_several_messages_at_once() -> None:
    from types import SimpleNamespace

    from ptcproject.celery import _fit_worker_to_queue

    for queues, most in ((["exec"], 1), (["tools"], 16), (["exec", "tools"], 1)):
        conf = SimpleNamespace(worker_concurrency=4, broker_transport_options={"pop_most": 16}, worker_send_task_events=True)
        _fit_worker_to_queue(conf=conf, options={"queues": queues})
        assert conf.broker_transport_options["pop_most"] == most, queues


def test_workers_start_without_mingle_or_gossip(stack_env: dict[str, str]) -> None:
    """Celery's mingle asked every other worker at a worker's start for the tasks revoked, waiting a
    second for replies, and its gossip bound a queue of each worker's to the events exchange, so
    each worker took every other worker's heartbeats. Nothing here revokes a task or elects a
    worker: a worker, started as our deployments start it, does neither."""
    prefix = f"{REDIS_PREFIX}start-{uuid.uuid4().hex[:8]}:"
    argv = [str(BIN / "celery"), "-A", "ptcproject", "worker", "-Q", "tools", "-n", f"start-{os.getpid()}@%h", "-l", "info"]
    worker = Process("start-tools-worker", argv, {**stack_env, "PTC_REDIS_PREFIX": prefix}, ready=" ready.")
    worker.start()
    try:
        assert "mingle" not in worker.log.read_text(errors="replace")
        bound = redis.Redis.from_url(REDIS_URL).smembers(f"{prefix}_kombu.binding.celeryev")
        assert bound == set()
    finally:
        worker.stop()


def test_redis_messages_of_a_pop_not_handed_over_go_back_at_once_when_one_fails() -> None:
    with _redis_queue("fails", most=16) as broker:
        got: list[int] = []

        def on_message(body: Any, message: Any) -> None:
            got.append(body["n"])
            if body["n"] == 1:
                raise RuntimeError("the consumer failed on this one")

        broker.publish(5)
        channel = broker.conn.channel()
        with Consumer(channel, [broker.queue], callbacks=[on_message]):
            with pytest.raises(RuntimeError):
                broker.conn.drain_events(timeout=5)
            assert got == [0, 1]
            # The three never handed over are back at the head of the queue, in order, now; the
            # two handed over stay unacked with their consumer.
            assert broker.waiting() == 3 and broker.unacked() == 2
            broker.drain(lambda: len(got) >= 5)
        assert got == [0, 1, 2, 3, 4]


def test_redis_messages_taken_while_it_is_full_are_recorded_unacked_once_it_has_room(tmp_path: Path) -> None:
    """Handed over without their unacked record (a full Redis refused it), messages were lost should
    their worker die before acking them, even long after Redis had room again. Their records are
    written once it has room, so they are restored as any other."""
    server = RedisServer(tmp_path)
    server.start()
    try:
        with _redis_queue("later", most=16, url=server.url) as broker:
            received: list[Any] = []
            broker.publish(3)
            with broker.conn.channel() as channel, Consumer(channel, [broker.queue], callbacks=[lambda _, m: received.append(m)]):
                broker.server.config_set("maxmemory", "1")
                try:
                    broker.drain(lambda: len(received) >= 3)
                    broker.conn.transport._acks_flush()  # a turn of the loop's end: still full, nothing written
                    assert broker.unacked() == 0 and broker.waiting() == 0
                finally:
                    broker.server.config_set("maxmemory", "0")
                received[0].ack()
                deadline = time.monotonic() + 30
                while broker.unacked() < 2:  # a later turn's end (at most one a second tries)
                    assert time.monotonic() < deadline, "the records were not written"
                    broker.conn.transport._acks_flush()
                    time.sleep(0.05)
                assert broker.unacked() == 2
            # The channel closed with two unacked: back in the queue from their records.
            assert broker.waiting() == 2 and broker.unacked() == 0
            again: list[int] = []
            with broker.conn.channel() as channel, Consumer(channel, [broker.queue], callbacks=[_acking(again)]):
                broker.drain(lambda: len(again) >= 2)
            assert sorted(again) == [1, 2]
    finally:
        server.stop()


def test_a_message_that_cant_go_back_while_redis_stays_full_is_logged_with_the_command_that_puts_it_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A message handed over while Redis was full, not run, that can't go back to its queue by the
    end of its channel's restore_wait is logged LOST with a redis-cli command that puts it back:
    one an operator can paste, whatever quotes the message holds."""
    server = RedisServer(tmp_path)
    server.start()
    try:
        with _redis_queue("lost", most=16, url=server.url, restore_wait=0) as broker:
            with broker.conn.channel() as channel:
                Producer(channel).publish(
                    {"n": 0, "text": "it's"}, exchange=broker.queue.exchange, routing_key="lost", declare=[broker.queue]
                )
            received: list[Any] = []
            with caplog.at_level("ERROR", logger="ptc.broker"):
                broker.server.config_set("maxmemory", "1")
                try:
                    with (
                        broker.conn.channel() as channel,
                        Consumer(channel, [broker.queue], callbacks=[lambda _, m: received.append(m)]),
                    ):
                        broker.drain(lambda: len(received) >= 1)
                    # Closed with the message unacked, not run, and no record of it in Redis.
                finally:
                    broker.server.config_set("maxmemory", "0")
            assert broker.waiting() == 0 and broker.unacked() == 0
            [lost] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("LOST")]
            command = shlex.split(lost.split("put it back with: ", 1)[1])
            assert command[:2] == ["redis-cli", "RPUSH"], lost
            subprocess.run([command[0], "-u", server.url, *command[1:]], check=True, capture_output=True)
            again: list[Any] = []
            with (
                broker.conn.channel() as channel,
                Consumer(channel, [broker.queue], callbacks=[lambda body, m: (again.append(body), m.ack())]),
            ):
                broker.drain(lambda: len(again) >= 1)
            assert again == [{"n": 0, "text": "it's"}]
    finally:
        server.stop()


def test_commands_riding_a_lone_message_go_in_its_round_trip_once_and_never_fail_it(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A tool call's start event rides its message to Redis (publish_riding): one round trip for
    both, the event first, sent once however many messages the block publishes; one Redis refuses
    is logged, and the message is queued all the same."""
    from redis.connection import Connection as RedisConnection

    from ptcproject.broker import publish_riding

    sends: list[int] = []
    send = RedisConnection.send_packed_command
    monkeypatch.setattr(RedisConnection, "send_packed_command", lambda self, *a, **k: (sends.append(1), send(self, *a, **k))[1])
    with _redis_queue("riding", most=16) as broker:
        stream = f"{broker.prefix}events"
        with broker.conn.channel() as channel:
            producer = Producer(channel)
            producer.publish({"n": 0}, exchange="", routing_key="riding")  # the channel's connection made
            sends.clear()
            with publish_riding(lambda pipe: pipe.xadd(stream, {"event": "start"})) as sent:
                producer.publish({"n": 1}, exchange="", routing_key="riding")
                assert len(sends) == 1 and sent()  # the event and the message in one round trip
                producer.publish({"n": 2}, exchange="", routing_key="riding")
            assert broker.server.xlen(stream) == 1 and broker.waiting() == 3
            # A command Redis refuses (INCR of the stream) costs the message nothing.
            with caplog.at_level("WARNING", logger="ptc.broker"), publish_riding(lambda pipe: pipe.incr(stream)):
                producer.publish({"n": 3}, exchange="", routing_key="riding")
            assert broker.waiting() == 4
            assert any("Redis refused a command sent with a message" in r.getMessage() for r in caplog.records)
            # Outside a block a message goes alone, as kombu sends it.
            producer.publish({"n": 4}, exchange="", routing_key="riding")
            assert broker.server.xlen(stream) == 1 and broker.waiting() == 5


def test_commands_riding_a_lone_message_go_with_its_retry_when_its_first_try_failed(tmp_path: Path) -> None:
    """A message whose publish failed on its way to Redis (Redis restarting), then went on a retry,
    went without the commands riding it: a tool call's start event was never in its job's log. They
    go with the try that reaches Redis."""
    from ptcproject.broker import publish_riding

    server = RedisServer(tmp_path)
    server.start()
    try:
        with _redis_queue("riding-retried", most=16, url=server.url) as broker:
            stream = f"{broker.prefix}events"
            with broker.conn.channel() as channel:
                producer = Producer(channel)
                producer.publish({"n": 0}, exchange="", routing_key="riding-retried")  # the channel's connection made
                server.stop()
                restarts: list[int] = []

                def restart(exc: Exception, interval: float) -> None:  # kombu's, between its tries
                    if not restarts:
                        restarts.append(1)
                        server.start()

                policy = {"max_retries": 5, "interval_start": 0, "interval_step": 0.1, "interval_max": 0.2, "errback": restart}
                with publish_riding(lambda pipe: pipe.xadd(stream, {"event": "start"})) as sent:
                    producer.publish({"n": 1}, exchange="", routing_key="riding-retried", retry=True, retry_policy=policy)
                    assert restarts and sent()
            assert broker.waiting() == 1  # the restarted Redis has the retried message (the first went with it)
            assert broker.server.xlen(stream) == 1
    finally:
        server.stop()
