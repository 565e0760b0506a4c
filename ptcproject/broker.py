"""kombu's transports, with two defects worked around, and one cost.

Filesystem (the embedded default): kombu writes a message into its final file name, so a consumer
listing the folder can take the file before its content is written, read nothing, and die on the
JSON (Celery calls that unrecoverable). Here a message is written under another name and renamed
into place: a rename is atomic, so a consumer sees a whole message or none. And a reader can find
an exchange table that kombu has created but not yet written (empty), as can a worker binding its
queue to it: each reads again shortly.

Redis:

When a worker loses its broker connection while it holds an unacknowledged message (an exec job
runs for its whole life with ``acks_late``), kombu closes the channel, then tries to restore that
message, and later to ack it, through the connection it has dropped. Both raise ``AttributeError``
('NoneType' object has no attribute 'hostname' / 'client'), which Celery treats as unrecoverable:
the worker exits and takes every running job with it. Here both are logged and the worker goes on;
a message left in Redis's unacked set is restored after ``visibility_timeout`` as usual, and our
tasks find their record already claimed, so a restore never runs anything twice. And kombu made a
new Redis client for every message it sent, kept track of or acked: here one per connection pool.

The cost: kombu takes one message per round trip (``BRPOP``), then spends a second round trip
recording it as unacked, on the consumer's one thread. A burst of tool calls waits in the queue
behind that thread. Here a consumer takes up to ``pop_most`` waiting messages at once (``BLMPOP``,
Redis 7), as many as it has free slots for, hands them over, and then records them all as unacked
in one round trip: a task starts without waiting for its record, which is written while it runs
(an ack that comes first, on any thread, is held until the record is written, so no record outlives
its ack). A worker killed between a pop and its record loses what it popped, as kombu's loses the
one message it popped: a tool call lost so is failed by its bridge at its timeout, and nothing is
charged for it. Without BLMPOP (Redis 6, or an
ACL that refuses INFO), or with ``pop_most`` 1, it is kombu's BRPOP.

A worker started while Redis is full (its maxmemory reached, noeviction) died at its start: Celery's
start-up writes to Redis, and a full Redis refuses each write. In order: the restore round of
unacked messages past their visibility timeout (its lock, a SET), then each queue the worker
declares (mingle's reply queue, gossip's, its task queues, its direct queue, its pidbox): kombu
reads the queue's length in a MULTI, which a full Redis refuses whole though it only reads, and
writes its binding (SADD, or a script for a queue that expires); and mingle deletes its reply queue
in a MULTI. Here the restore round is skipped (the next one tries again), lengths are read and
queues deleted outside a MULTI, and a binding Redis refuses is left
as it is when Redis has it already; one of Celery's expiring queues (control replies, gossip, the
pidbox) is bound by kombu's periodic refresh once there is room; any other waits, the worker saying
so, until Redis has room. So the worker starts, and consumes once its queues are bound.

A message taken while Redis is full is handed over without its unacked record (Redis refuses it):
Redis has no copy of it, only the worker's memory. Its record is written once Redis has room (at a
turn's end in the event loop, tried at most every second); a channel closed before (a warm shutdown)
puts such a message back on its queue from memory, waiting ``restore_wait`` for room (a cold
shutdown waits for nothing), and logs as an error, whole, one it could not. Only a worker killed
while Redis is full loses them, and one killed during that wait has logged, as it began, the
command that puts each back.

A message published alone can take commands with it (``publish_riding``), in its own round trip,
sent before it: a tool call's start event, which must be in Redis before its worker's end event,
costs the bridge no round trip of its own.

And kombu acks each message in a round trip of its own, on that same thread, as its task ends: in a
burst, four tenths of that thread's time. In a worker's event loop, the acks of one turn of the loop
go in one round trip at its end, before it waits again. An ack lost so (Redis gone at that moment,
or the worker killed within the turn) is a message restored after ``visibility_timeout``: the
task finds its record ended, and nothing runs twice.
"""

import logging
import os
import shlex
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from queue import Empty
from time import monotonic, sleep, time
from typing import Any

from kombu.transport import filesystem, redis, virtual
from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import dumps, loads
from redis.exceptions import OutOfMemoryError, RedisError, ResponseError

logger = logging.getLogger("ptc.broker")
# How often a reader tries an exchange table that is still being written (5 ms apart).
TABLE_READ_TRIES = 200
# A queue's binding that a full Redis refuses is tried again this often, and said again in the log
# this often, until Redis has room.
ROOM_TRY_SECONDS = 1.0
ROOM_SAY_SECONDS = 30.0
# A refresh of the bindings of expiring queues that a full Redis refuses (kombu's, every second) is
# said again this often at most, while Redis stays full.
REFUSED_SAY_SECONDS = 60.0


def broker_trouble(exc: BaseException) -> str:
    """What a send to the broker (or Redis) that failed says of it, for an error's message: that it
    "is full" when Redis refused the write for want of memory (its maxmemory reached, noeviction;
    kombu raises that as a connection error), else that it "is unreachable"."""
    seen: BaseException | None = exc
    chain: set[int] = set()
    while seen is not None and id(seen) not in chain:  # a chain may loop back on itself
        if isinstance(seen, OutOfMemoryError):
            return "is full (Redis has reached its maxmemory)"
        chain.add(id(seen))
        seen = seen.__cause__ or seen.__context__
    return "is unreachable"


# The commands the next message this thread publishes alone takes with it (publish_riding).
_riders = threading.local()


@contextmanager
def publish_riding(add: Callable[[Any], None]) -> Iterator[Callable[[], bool]]:
    """Within the block, the first message this thread publishes alone (not in a batch) on the
    Redis transport goes to Redis in one round trip with the commands ``add(pipeline)`` queues,
    run before it: what must be in Redis before any consumer can take the message costs no round
    trip of its own. They go with the message's one try that Redis answers (a try that fails on
    its way, Redis unreachable, leaves them to the publish's retry), and their errors are logged,
    never raised: the message's alone are the publish's. The pipeline is kombu's:
    the keys of the commands kombu prefixes (LPUSH, HSET, ...) get ``global_keyprefix``, others' (XADD,
    EXPIRE) are as given. Yield a function that says whether Redis answered them, with a message
    (whose publish may have failed: Redis refused it); not if the block published nothing, or every
    try of its failed on its way, or not on this transport."""
    _riders.add, _riders.sent = add, False
    try:
        yield lambda: bool(_riders.sent)
    finally:
        _riders.add = None


def _unrecorded_warn(count: int) -> None:
    """A full Redis (maxmemory, noeviction) took messages off their queue but refused their unacked
    records, and can't take them back either (a push needs memory): they are handed over all the
    same. Raised, the error lost them, and killed the worker."""
    logger.warning(
        "Redis is full (its maxmemory): %d messages taken from their queue are handed over without their unacked "
        "record, which this worker writes once Redis has room; should it be killed before that, they are lost "
        "(a warm shutdown puts back those not started)",
        count,
    )


def _named(payload: dict[str, Any]) -> str:
    """A message as a log names it: its task, its task id and its arguments (a job's or a call's id)."""
    headers = payload.get("headers") or {}
    return f"{headers.get('task', '?')}[{headers.get('id', '?')}]{headers.get('argsrepr', '')}"


class QoS(redis.QoS):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._recorded: set[str] = set()  # taken by a multi-pop, recorded unacked by it (append_taken)
        # Taken by a multi-pop and handed over, their unacked records not written yet: their acks
        # wait for them (a record written after its ack would be restored, and its task run again).
        self._recording: set[str] = set()
        self._recording_lock = threading.Lock()
        self._acks_held: list[str] = []  # acked in this turn of the event loop, not yet in Redis
        # Handed over while Redis was full, without an unacked record: Redis has no copy of these,
        # only this worker's memory (_delivered). Recorded once there is room (unrecorded_record).
        self._unrecorded: set[str] = set()
        self._unrecorded_tried = 0.0  # when unrecorded_record last tried (monotonic)

    def taking(self, payloads: list[dict[str, Any]]) -> None:
        """Messages just taken from their queue are handed over before ``append_taken`` records them:
        ``append`` leaves them to it, and their acks wait for it."""
        tags = [payload["properties"]["delivery_tag"] for payload in payloads]
        self._recorded.update(tags)
        with self._recording_lock:
            self._recording.update(tags)

    def untaken(self, payloads: list[dict[str, Any]]) -> None:
        """Put messages taken but never handed over (nor recorded) back at the head of their queue,
        in their order, from memory."""
        tags = {payload["properties"]["delivery_tag"] for payload in payloads}
        self._recorded.difference_update(tags)
        with self._recording_lock:
            self._recording.difference_update(tags)
        self._unrecorded_put(payloads, wait=0)

    def append_taken(self, payloads: list[dict[str, Any]]) -> None:
        """Record messages taken from their queue (``taking``) and handed over as unacked, in one
        round trip, as ``append`` does each (its own round trip) when it is handed over. The acks
        that came meanwhile go after it: at the turn's end in the event loop, else now."""
        now = time()
        try:
            with self.pipe_or_acquire() as pipe:
                for payload in payloads:
                    properties = payload["properties"]
                    tag, delivery = properties["delivery_tag"], properties["delivery_info"]
                    pipe.zadd(self.unacked_index_key, {tag: now})
                    pipe.hset(self.unacked_key, tag, dumps([payload, delivery["exchange"], delivery["routing_key"]]))
                pipe.execute()
        except OutOfMemoryError:
            _unrecorded_warn(len(payloads))
            # Those acked already need no record (nor, so, a restore from memory).
            tags = (payload["properties"]["delivery_tag"] for payload in payloads)
            self._unrecorded.update(tag for tag in tags if tag in self._delivered)
            self._unrecorded_tried = monotonic()
        finally:
            with self._recording_lock:
                self._recording.difference_update(payload["properties"]["delivery_tag"] for payload in payloads)
            transport = self.channel.connection
            if transport is None or not transport.in_loop():
                self.acks_flush()

    def unrecorded_record(self) -> None:
        """Write the unacked records a full Redis refused, for the messages still held, once it has
        room (tried at most every ROOM_TRY_SECONDS): from then on they are restored, as any other,
        should this worker die. A message acked from another thread meanwhile may be recorded after
        its ack: it is restored after the visibility timeout, and its task finds its record ended."""
        if not self._unrecorded or monotonic() - self._unrecorded_tried < ROOM_TRY_SECONDS:
            return
        self._unrecorded_tried = monotonic()
        held = [(tag, message) for tag in list(self._unrecorded) if (message := self._delivered.get(tag)) is not None]
        now = time()
        try:
            with self.pipe_or_acquire() as pipe:  # a MULTI: all recorded, or none
                for tag, message in held:
                    delivery = message.delivery_info
                    pipe.zadd(self.unacked_index_key, {tag: now})
                    pipe.hset(self.unacked_key, tag, dumps([message._raw, delivery["exchange"], delivery["routing_key"]]))
                pipe.execute()
        except (AttributeError, RedisError):  # still full (or gone): the next turn tries again
            return
        self._unrecorded.difference_update(tag for tag, _ in held)
        logger.warning(
            "Redis has room again: the %d messages handed over without their unacked record are recorded now (%s)",
            len(held),
            ", ".join(_named(message._raw) for _, message in held),
        )

    def _unrecorded_put(self, payloads: list[dict[str, Any]], *, wait: float) -> None:
        """Put messages handed over without an unacked record (Redis was full) back at the head of
        their queue, in their order, from this worker's memory: Redis has no copy of them. While Redis
        is full, try again every ROOM_TRY_SECONDS for up to ``wait`` seconds, stopping at once on a
        cold shutdown. Each message waited for is logged as the wait starts with the command that puts
        it back, since the worker may be killed during the wait (its pod's grace period over) and log
        nothing more; then those that went back; one that can't go back is logged LOST with it."""
        for payload in payloads:  # marked as kombu marks a message it restores, in the commands logged too
            payload.setdefault("headers", {})["redelivered"] = True
            payload["properties"]["delivery_info"]["redelivered"] = True
        left = list(payloads)  # those not back: the first ones (each goes to the head, the last first)
        deadline = monotonic() + wait
        trouble, stopped = "", ""
        try:
            while left:
                try:
                    with self.channel.conn_or_acquire() as client:
                        while left:
                            for key in self._queue_keys(left[-1]):
                                client.rpush(key, dumps(left[-1]))
                            left.pop()
                except OutOfMemoryError as exc:
                    first, trouble = not trouble, broker_trouble(exc)
                    if _cold_shutdown():  # asked before the wait or during it: this was its last try
                        stopped = "; a cold shutdown does not wait"
                        break
                    if monotonic() + ROOM_TRY_SECONDS > deadline:
                        break
                    if first:
                        for payload in left:
                            logger.error(
                                "NOT BACK YET: message %s, taken while Redis was full and unacked, is in this worker's "
                                "memory only: it can't go back to its queue while the broker %s. The worker tries "
                                "again every %g s for %g s, then logs whether it went back. Should the worker end "
                                "before it says so (killed), put it back with: %s",
                                _named(payload),
                                trouble,
                                ROOM_TRY_SECONDS,
                                wait,
                                self._put_back_command(payload),
                            )
                    _room_wait(stop=_cold_shutdown)
                except (AttributeError, RedisError) as exc:  # AttributeError: kombu's, on a connection it has dropped
                    trouble = broker_trouble(exc) if isinstance(exc, RedisError) else "is unreachable"
                    break
        except BaseException as exc:  # a signal's WorkerTerminate, raised in the wait: said below, then raised on
            stopped = f"; stopped by {type(exc).__name__}"
            raise
        finally:
            back = payloads[len(left) :]
            if trouble and back:
                logger.warning(
                    "the broker has room again: %d messages went back to their queue (%s)",
                    len(back),
                    ", ".join(_named(payload) for payload in back),
                )
            for payload in left:
                logger.error(
                    "LOST: message %s, taken while Redis was full and unacked, could not go back to its queue (the "
                    "broker %s%s); put it back with: %s",
                    _named(payload),
                    trouble or "is unreachable",
                    stopped,
                    self._put_back_command(payload),
                )

    def _put_back_command(self, payload: dict[str, Any]) -> str:
        """The shell command that puts ``payload`` back at the head of its queue: a ``redis-cli RPUSH``
        a queue, its key and the message quoted for a shell."""
        return " ; ".join(
            f"redis-cli RPUSH {shlex.quote(self.channel.global_keyprefix + key)} {shlex.quote(dumps(payload))}"
            for key in self._queue_keys(payload)
        )

    def _queue_keys(self, payload: dict[str, Any]) -> list[str]:
        """The Redis keys (less the prefix kombu's client adds) of the lists a message goes back to:
        its exchange's queues for its routing key (one, for Celery's), the list of its priority."""
        channel, delivery = self.channel, payload["properties"]["delivery_info"]
        priority = channel._get_message_priority(payload, reverse=False)
        return [
            channel._q_for_pri(queue, priority)
            for queue in sorted(channel._lookup(delivery["exchange"], delivery["routing_key"]))
        ]

    def append(self, message: Any, delivery_tag: str) -> None:
        if delivery_tag in self._recorded:
            self._recorded.discard(delivery_tag)
            virtual.QoS.append(self, message, delivery_tag)  # in memory only: Redis has it
            return
        try:
            super().append(message, delivery_tag)
        except OutOfMemoryError:
            _unrecorded_warn(1)
            self._unrecorded.add(delivery_tag)
            self._unrecorded_tried = monotonic()
            virtual.QoS.append(self, message, delivery_tag)

    def restore_visible(self, *args: Any, **kwargs: Any) -> None:
        try:
            super().restore_visible(*args, **kwargs)
        except OutOfMemoryError as exc:  # its lock is a SET: a worker starting while Redis was full died of it
            logger.warning(
                "the broker %s: messages unacked past their visibility timeout are not restored this round; the next tries again",
                broker_trouble(exc),
            )

    def restore_unacked(self, client: Any = None) -> None:
        # Those Redis has no record of go back from memory (kombu's restore reads the record, and
        # found none: each was lost), waiting a while for room should Redis still be full.
        unrecorded = [(tag, message._raw) for tag, message in list(self._delivered.items()) if tag in self._unrecorded]
        for tag, _ in unrecorded:
            self._delivered.pop(tag, None)
        self._unrecorded.clear()
        if unrecorded:
            self._unrecorded_put([payload for _, payload in unrecorded], wait=self.channel.restore_wait)
        try:
            super().restore_unacked(client)
        except AttributeError:
            logger.warning("could not restore unacked messages on a lost connection; visibility timeout will")
            self._delivered.clear()
        except RedisError as exc:  # a full Redis refuses kombu's restore (a MULTI): Redis keeps their records
            logger.warning(
                "could not put back %d unacked messages (the broker %s); they are restored after the visibility timeout",
                len(self._delivered),
                broker_trouble(exc),
            )
            self._delivered.clear()

    def ack(self, delivery_tag: Any) -> None:
        self._unrecorded.discard(delivery_tag)
        virtual.QoS.ack(self, delivery_tag)  # its slot is free at once
        with self._recording_lock:
            if delivery_tag in self._recording:  # Redis is told once its record is written (append_taken)
                self._acks_held.append(delivery_tag)
                return
        transport = self.channel.connection  # None once the channel is closed (its connection lost)
        if transport is not None and transport.in_loop():
            self._acks_held.append(delivery_tag)  # Redis is told at the turn's end
        else:
            self._acks_send([delivery_tag])

    def acks_flush(self) -> None:
        """Take the acks held in this turn of the event loop off Redis's unacked records, in one round trip."""
        tags, self._acks_held = self._acks_held, []
        if tags:
            self._acks_send(tags)

    def _acks_send(self, tags: list[str]) -> None:
        """Take ``tags`` off Redis's unacked records, in one round trip, or say why not: a message
        whose ack is lost is restored after visibility_timeout, and its task finds its record ended.

        Not in a transaction, as kombu's ack is: a full Redis (maxmemory, noeviction) refuses every
        command queued in a MULTI, a deletion too, and the error killed the worker. Alone, a deletion
        is served, and frees memory. The record goes before its index entry: an entry left without
        its record is skipped by the restore."""
        try:
            with self.channel.conn_or_acquire() as client:
                client.pipeline(transaction=False).hdel(self.unacked_key, *tags).zrem(self.unacked_index_key, *tags).execute()
        except (AttributeError, RedisError) as exc:  # AttributeError: kombu's, on a connection it has dropped
            logger.warning("could not ack %d messages (%s); their records already say how they ended", len(tags), exc)

    def reject(self, delivery_tag: Any, requeue: bool = False) -> None:
        if not requeue:
            self.ack(delivery_tag)  # what kombu's reject without requeue does, in a MULTI
            return
        with self._recording_lock:
            recording = delivery_tag in self._recording
        if recording:  # Redis has no record to restore it from yet: back from memory, its record deleted once written
            message = self._delivered.get(delivery_tag)
            self.ack(delivery_tag)
            if message is not None:
                self._unrecorded_put([message._raw], wait=0)
            return
        if delivery_tag in self._unrecorded:  # Redis has no record to restore it from
            message = self._delivered.get(delivery_tag)
            self._unrecorded.discard(delivery_tag)
            virtual.QoS.ack(self, delivery_tag)
            if message is not None:
                self._unrecorded_put([message._raw], wait=0)
            return
        try:
            super().reject(delivery_tag, requeue=requeue)
        except (AttributeError, RedisError) as exc:
            logger.warning("could not put a rejected message back (%s); restored after the visibility timeout", exc)


class Channel(redis.Channel):
    QoS = QoS
    _sync_client: Any = None
    # The most messages one pop takes (transport option; 1 is kombu's own BRPOP). Within a
    # consumer's free slots: more would take a burst away from the other workers on the queue.
    pop_most = 16
    # How long a channel closing (a worker's warm shutdown) waits for a full Redis to have room to
    # take back the messages it holds that Redis has no record of (transport option).
    restore_wait = 60.0
    from_transport_options = (*redis.Channel.from_transport_options, "pop_most", "restore_wait")  # type: ignore[assignment]
    _multi_pop: bool | None = None  # whether the server has BLMPOP (Redis 7), asked once

    def _create_client(self, asynchronous: bool = False) -> Any:
        # kombu builds a new client (redis-py's Redis(), ~70 us of CPU) for every publish, and for
        # every delivered message's unacked bookkeeping and its ack: one client per pool serves
        # them all (redis-py's clients are thread-safe; each command takes a pooled connection).
        if asynchronous:
            return super()._create_client(asynchronous=True)
        client = self._sync_client
        if client is None or client.connection_pool is not self.pool:
            client = self._sync_client = super()._create_client()
        return client

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._no_ack: set[str] = set()  # queues consumed without acks (Celery's replies): nothing to record
        super().__init__(*args, **kwargs)

    def close(self) -> None:
        if self._qos is not None:  # a turn's acks, sent before the channel goes
            self._qos.acks_flush()
        super().close()

    def _put(self, queue: str, message: Any, **kwargs: Any) -> None:
        add = getattr(_riders, "add", None)
        if add is None or kwargs.get("_publish_batch") is not None:
            return super()._put(queue, message, **kwargs)
        _riders.add, _riders.sent = None, True  # once: a retried publish goes without them
        try:
            with self.conn_or_acquire() as client:
                pipe = client.pipeline(transaction=False)
                try:
                    add(pipe)
                except Exception:
                    logger.warning("could not queue the commands sent with a message; it goes alone", exc_info=True)
                    pipe.reset()
                riders = len(pipe.command_stack)
                pipe.lpush(self._q_for_pri(queue, self._get_message_priority(message, reverse=False)), dumps(message))
                if self._expires and queue in self._expires:  # as kombu's _put
                    for pri in self.priority_steps:
                        pipe.pexpire(self._q_for_pri(queue, pri), self._expires[queue])
                replies = pipe.execute(raise_on_error=False)
        except Exception:
            # Not answered (Redis unreachable, or restarting): they go with the message again on
            # the publish's retry, if any (a retry that went without them queued the message, and
            # they were never sent: a call's end event with no start in its job's log).
            _riders.add, _riders.sent = add, False
            raise
        for reply in replies[:riders]:
            if isinstance(reply, Exception):
                logger.warning("Redis refused a command sent with a message: %s", reply)
        for reply in replies[riders:]:
            if isinstance(reply, Exception):
                raise reply
        return None

    def basic_consume(self, queue: str, *args: Any, **kwargs: Any) -> Any:
        no_ack = kwargs["no_ack"] if "no_ack" in kwargs else bool(args and args[0])
        (self._no_ack.add if no_ack else self._no_ack.discard)(queue)
        return super().basic_consume(queue, *args, **kwargs)

    # kombu reads a queue's lengths, and deletes its lists, in a MULTI, which a full Redis refuses
    # whole though a read or a DEL alone is served: every queue a worker declares at its start is
    # measured so, and mingle deletes its reply queue. These are kombu's, outside a MULTI.
    def _size(self, queue: str) -> int:
        with self.conn_or_acquire() as client:
            pipe = client.pipeline(transaction=False)
            for pri in self.priority_steps:
                pipe.llen(self._q_for_pri(queue, pri))
            return sum(size for size in pipe.execute() if isinstance(size, int))

    def _delete(self, queue: str, exchange: str, routing_key: str, pattern: str, *args: Any, **kwargs: Any) -> None:
        self.auto_delete_queues.discard(queue)
        member = self.sep.join([routing_key or "", pattern or "", queue or ""])
        with self.conn_or_acquire(client=kwargs.get("client")) as client:
            pipe = client.pipeline(transaction=False)
            pipe.srem(self.keyprefix_queue % (exchange,), member)
            pipe.srem(self.keyprefix_binding_permanent % (exchange,), member)
            for pri in self.priority_steps:
                pipe.delete(self._q_for_pri(queue, pri))
            pipe.execute()

    def _queue_bind(self, exchange: str, routing_key: str, pattern: str, queue: str) -> None:
        """Bind ``queue`` as kombu does; while Redis is full (it refuses the write), leave a binding
        it already has as it is, leave one of Celery's expiring queues to kombu's periodic refresh
        (maybe_refresh_binding_expiry, which writes it again once there is room), and wait for room
        for any other: a publish through its exchange would find no queue bound, and be dropped."""
        said_at: float | None = None
        while True:
            try:
                return super()._queue_bind(exchange, routing_key, pattern, queue)
            except OutOfMemoryError as exc:
                trouble = broker_trouble(exc)
            member = self.sep.join([routing_key or "", pattern or "", queue or ""])
            with self.conn_or_acquire() as client:
                # A read, served. SMEMBERS, which kombu's client prefixes (its SISMEMBER it does not).
                if member in {bytes_to_str(bound) for bound in client.smembers(self.keyprefix_queue % (exchange,))}:
                    logger.info("the broker %s: queue %s is bound to %s already", trouble, queue, exchange)
                    return None
            if queue in self._expires:
                logger.warning("the broker %s: queue %s is bound to %s once there is room", trouble, queue, exchange)
                return None
            if said_at is None or monotonic() - said_at >= ROOM_SAY_SECONDS:
                said_at = monotonic()
                logger.warning(
                    "the broker %s: this worker can't bind queue %s to %s, and consumes nothing until it has; "
                    "it tries again every %g s",
                    trouble,
                    queue,
                    exchange,
                    ROOM_TRY_SECONDS,
                )
            from celery.worker.state import maybe_shutdown

            _room_wait(stop=maybe_shutdown)  # a warm or cold shutdown: raises Celery's WorkerShutdown or WorkerTerminate

    def maybe_refresh_binding_expiry(self) -> None:
        # kombu's transport logs each refusal of this refresh (a script, which a full Redis refuses)
        # with two chained tracebacks, 60 lines, every second while Redis is full: a few lines say it
        # (_BindingRefusals). kombu moves its clock only when a refresh went through.
        refreshed_at = self._binding_expiry_refreshed_at
        queues = ", ".join(sorted(queue for queue in self._active_queues if queue in self._expires))
        try:
            super().maybe_refresh_binding_expiry()
        except OutOfMemoryError as exc:
            _binding_refusals.refused(trouble=broker_trouble(exc), queues=queues)
        else:
            if self._binding_expiry_refreshed_at != refreshed_at:
                _binding_refusals.refreshed(queues=queues)

    def _brpop_start(self, timeout: float | None = None) -> None:
        if self._multi_pop is None:
            info = self._server_info()
            self._evictions_warn(info)
            self._multi_pop = self.pop_most > 1 and self._server_pops_many(info)
        if not self._multi_pop:
            return super()._brpop_start(timeout)
        queues = self._queue_cycle.consume(len(self.active_queues))
        if not queues:
            return None
        keys = [self.global_keyprefix + self._q_for_pri(queue, pri) for pri in self.priority_steps for queue in queues]
        free = self.qos.can_consume_max_estimate()  # None: no prefetch limit
        most = self.pop_most if free is None else max(1, min(self.pop_most, free))
        self._in_poll = self.client.connection
        self._brpop_sent_at = monotonic()  # type: ignore[assignment]  # kombu's attribute, typed by its None
        wait = self.brpop_timeout if timeout is None else timeout
        self.client.connection.send_command("BLMPOP", wait or 0, len(keys), *keys, "RIGHT", "COUNT", most)
        return None

    def _server_info(self) -> dict[str, Any] | None:
        """The server's INFO (its default sections), asked once, as the consumer first pops; None
        from a server that refuses it (an ACL without @dangerous)."""
        try:
            return dict(self._create_client().info())
        except ResponseError as exc:
            logger.info("Redis refused INFO (%s): this consumer takes one message at a time", exc)
            return None

    def _server_pops_many(self, info: dict[str, Any] | None) -> bool:
        """Whether the server has BLMPOP (Redis 7); said once in the log. A server that refuses INFO
        is taken as one without: kombu's BRPOP needs list commands only."""
        if info is None:
            return False
        version = str(info["redis_version"])
        if int(version.split(".")[0]) < 7:
            logger.info("Redis %s has no BLMPOP (Redis 7): this consumer takes one message at a time", version)
            return False
        logger.info("this consumer takes up to %d waiting messages at once", self.pop_most)
        return True

    @staticmethod
    def _evictions_warn(info: dict[str, Any] | None) -> None:
        """Say, once, that the server may evict the queues under memory pressure: with a
        ``maxmemory`` and an ``allkeys-*`` policy, Redis drops keys of any kind, a queue's list or its
        unacked messages among them, and each message dropped is a job or a tool call lost with no
        error anywhere. The ``volatile-*`` policies drop only keys that expire, which no queue does."""
        if info is None or not int(info.get("maxmemory", 0)):
            return
        policy = str(info.get("maxmemory_policy", ""))
        if policy.startswith("allkeys-"):
            logger.warning(
                "the broker's Redis has maxmemory-policy %s: once full it evicts queued messages, each a job or a "
                "tool call lost without an error. Set maxmemory-policy noeviction (or a volatile-* policy) there",
                policy,
            )

    def _brpop_read(self, **options: Any) -> bool:
        if not self._multi_pop:
            return super()._brpop_read(**options)
        try:
            try:
                reply = self.client.parse_response(self.client.connection, "BLMPOP", **options)
            except self.connection_errors:
                self.client.connection.disconnect()  # reconnected on the next round, as kombu does
                raise
            if not reply:
                raise Empty()
            key, items = reply
            dest = bytes_to_str(key)[len(self.global_keyprefix) :].rsplit(self.sep, 1)[0]
            self._queue_cycle.rotate(dest)
            payloads = _messages(items, dest)
            acked = dest not in self._no_ack
            if not acked:
                for payload in payloads:
                    self.connection._deliver(payload, dest)
                return True
            # Handed over first, recorded unacked after, in one round trip: their tasks start a round
            # trip sooner (on a tools worker, every call's). Their acks wait for the record.
            self.qos.taking(payloads)
            handed = 0
            try:
                for payload in payloads:
                    handed += 1
                    self.connection._deliver(payload, dest)
            finally:
                if handed < len(payloads):  # one failed: the rest would never be handed over
                    self.qos.untaken(payloads[handed:])
                self.qos.append_taken(payloads[:handed])
            return True
        finally:
            self._in_poll = None  # type: ignore[assignment]  # as kombu's own _brpop_read leaves it
            self._flush_brpop_reauth()


class _BindingRefusals:
    """The refreshes of the bindings of expiring queues that a full Redis refuses, in this process
    (every channel's: one Redis is full for all): said as they begin, then at most every
    REFUSED_SAY_SECONDS with how many were refused since, and once as a refresh goes through again.
    kombu tries every second: an hour of a full Redis was 3,600 lines a worker."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # a process's connections may refresh from more than one thread
        self._began: float | None = None  # when the refusals began (monotonic); None: refreshes go through
        self._said = 0.0  # when they were last said
        self._since = 0  # refused since they were last said
        self._all = 0  # refused since they began

    def refused(self, *, trouble: str, queues: str) -> None:
        with self._lock:
            now = monotonic()
            self._all += 1
            if self._began is None:
                self._began, self._said, self._since = now, now, 0
                logger.warning(
                    "the broker %s: the bindings of queues %s are not refreshed (kombu tries again every second; "
                    "said again at most every %g s while it goes on)",
                    trouble,
                    queues,
                    REFUSED_SAY_SECONDS,
                )
                return
            self._since += 1
            if now - self._said >= REFUSED_SAY_SECONDS:
                logger.warning(
                    "the broker %s: the bindings of queues %s are still not refreshed (%d refused in the last %.0f s)",
                    trouble,
                    queues,
                    self._since,
                    now - self._said,
                )
                self._said, self._since = now, 0

    def refreshed(self, *, queues: str) -> None:
        with self._lock:
            if self._began is None:
                return
            logger.warning(
                "the broker has room again: the bindings of queues %s are refreshed again (%d refused over %.0f s)",
                queues,
                self._all,
                monotonic() - self._began,
            )
            self._began, self._all = None, 0


_binding_refusals = _BindingRefusals()


def _room_wait(stop: Callable[[], object]) -> None:
    """Wait ROOM_TRY_SECONDS for a full Redis to have room, or less: until ``stop()`` says the worker
    has been asked to stop (Celery's signal handlers only say so, in its state), or raises."""
    deadline = monotonic() + ROOM_TRY_SECONDS
    while not stop():
        left = deadline - monotonic()
        if left <= 0:
            return
        sleep(min(left, 0.1))


def _cold_shutdown() -> bool:
    """Whether Celery has been asked for a cold shutdown (SIGQUIT, or SIGTERM with
    REMAP_SIGTERM=SIGQUIT): the worker stops at once, and waits for nothing."""
    from celery.worker import state

    return state.should_terminate is not None and state.should_terminate is not False  # as maybe_shutdown reads it


def _messages(items: list[bytes], queue: str) -> list[dict[str, Any]]:
    """The messages of a pop, less any that is not one of kombu's (logged and dropped: where kombu
    takes one message at a time, such a message is lost too, and here it costs no other its place)."""
    messages = []
    for item in items:
        try:
            payload = loads(bytes_to_str(item))
            properties = payload["properties"]
            if properties["delivery_tag"] and {"exchange", "routing_key"} <= properties["delivery_info"].keys():
                messages.append(payload)
                continue
        except (ValueError, TypeError, KeyError, AttributeError):  # not JSON, or not a kombu message
            pass
        logger.error("dropped a malformed message of %d bytes from queue %s", len(item), queue)
    return messages


class Transport(redis.Transport):
    Channel = Channel
    _loop_thread: int | None = None  # the thread of the event loop this transport is registered with

    def register_with_event_loop(self, connection: Any, loop: Any) -> None:
        super().register_with_event_loop(connection, loop)
        self._loop_thread = threading.get_ident()
        loop.on_tick.add(self._acks_flush)  # each turn, before the loop waits (a set: once)

    def in_loop(self) -> bool:
        """Whether this is the thread of the event loop, whose acks wait for the turn's end."""
        return self._loop_thread == threading.get_ident()

    def _acks_flush(self) -> None:
        for channel in self.channels:
            if channel._qos is not None:  # one that never consumed has none to make
                channel._qos.acks_flush()
                channel._qos.unrecorded_record()


class FilesystemChannel(filesystem.Channel):
    # kombu's own filesystem.Channel._put, which this overrides, names AbstractChannel's ``message``
    # ``payload``: no one name satisfies both, and every caller passes it by position.
    def _put(self, queue: str, payload: Any, **kwargs: Any) -> None:  # type: ignore[override]
        name = f"{round(monotonic() * 1000)}_{uuid.uuid4()}.{queue}.msg"
        final = os.path.join(self.data_folder_out, name)
        partial = f"{final}.part"  # not "<queue>.msg": no consumer takes it
        with open(partial, "wb") as handle:
            handle.write(dumps(payload).encode())
        os.replace(partial, final)

    # kombu creates a new exchange table with open("wb") before it locks and writes it, so another
    # worker binding its queue (or a reader) can lock and read the empty file in between, and die
    # on the JSON: the quickstart's two workers start at once. Empty means "being written": the
    # writer takes its lock at once, so read again shortly. Nothing was written before the read.
    def get_table(self, exchange: str) -> Any:
        return _while_written(lambda: super(FilesystemChannel, self).get_table(exchange))

    def _queue_bind(self, exchange: str, routing_key: str, pattern: str, queue: str) -> None:
        _while_written(lambda: super(FilesystemChannel, self)._queue_bind(exchange, routing_key, pattern, queue))


def _while_written(read: Callable[[], Any]) -> Any:
    """``read()`` an exchange table, again while it is found empty (being written)."""
    for _ in range(TABLE_READ_TRIES):
        try:
            return read()
        except ValueError:  # JSONDecodeError of the empty file
            sleep(0.005)
    return read()


class FilesystemTransport(filesystem.Transport):
    Channel = FilesystemChannel
