"""Live events of a job: published by the workers as things happen, read back as Server-Sent Events.

With Redis, each job has a Redis Stream (``XADD``): ordered, with increasing ids, replayable from
any id, and read with a blocking ``XREAD`` (pushed, never polled). The embedded setup, with no
Redis, has a file per job (``LocalBackplane``), its readers woken through the job's channel. The
log expires a while after the job ends; after that, the same sequence is rebuilt from the
database records (without the stdout chunks: ``exec_end`` carries the final stdout).
"""

import asyncio
import functools
import json
import logging
import re
import time
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, ParamSpec, TypeVar

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import DatabaseError, connection
from django.utils import timezone

from execution.backplane import Events, JobsEvents, LocalBackplane, RedisBackplane, backplane, job_channel
from execution.models import ExecJob, ToolCall
from execution.selectors import calls_overdue_at, exec_job_with_calls, tool_call_is_client
from ptcproject.errors import ApplicationError
from ptcproject.metrics import event_lag_observe
from ptcproject.policy.seed import BOUNDS

logger = logging.getLogger("ptc.events")
# An event id as Redis Streams and this module write it: "<ms>-<seq>" (or "<ms>").
EVENT_ID = re.compile(r"[0-9]{1,20}(-[0-9]{1,20})?")  # not \d: any script's digits, which Redis refuses
P = ParamSpec("P")
R = TypeVar("R")


def valid_event_id(value: str) -> bool:
    """Return True if ``value`` can be an event id (what ``Last-Event-ID`` may resume after)."""
    return EVENT_ID.fullmatch(value) is not None and all(int(part) < 2**64 for part in value.split("-"))


def db_read(func: Callable[P, R]) -> Callable[P, Awaitable[R]]:
    """Make a database read awaitable from an async view, handing the connection back to the pool
    as soon as it is done, however it ends. A stream that lives for minutes, or is cut by its
    client or by an error, never holds one of the pool's connections."""

    def read(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return func(*args, **kwargs)
        finally:
            try:
                connection.close()
            except DatabaseError:
                pass

    # Not thread-sensitive: each read opens, uses and closes its own pooled connection, so it may run
    # on any thread. Thread-sensitive calls made outside a Django request (MCP's, a stream's) would
    # all queue on one shared thread, and one slow call (a broker retrying) would stall the rest.
    return sync_to_async(read, thread_sensitive=False)


@dataclass(frozen=True)
class Event:
    id: str  # "<ms>-<seq>", increasing within a job
    event: str
    data: dict[str, Any]

    def sse(self) -> str:
        return f"id: {self.id}\nevent: {self.event}\ndata: {json.dumps(self.data, separators=(',', ':'))}\n\n"


def _order(event_id: str) -> tuple[int, int]:
    ms, _, seq = event_id.partition("-")
    try:
        return int(ms), int(seq or 0)
    except ValueError:
        return 0, 0


# -- Followers -----------------------------------------------------------------------------------
class FollowPlace:
    """A place among one user's open follows of a job (``follow_admit``), held while it lives."""

    __slots__ = ("__weakref__",)


# The follows of a job open in this process, by user: event streams (SSE), and MCP calls that
# follow their job to its end. Each holds a Redis connection (its blocking XREAD) while it is open,
# and Redis's clients are the broker's too: one key opening thousands took them all, from every
# process. Weak: a place is given back when its holder is gone, however it went.
_FOLLOWS: dict[int, "weakref.WeakSet[FollowPlace]"] = {}
# Users who follow nothing are dropped from it when it has grown to twice its size at the last sweep.
FOLLOW_SWEEP_FROM = 64
_swept_at = FOLLOW_SWEEP_FROM


def follow_admit(*, user_id: int) -> FollowPlace:
    """Return a place among ``user_id``'s follows, held for as long as the caller keeps it (an SSE
    stream's generator, an MCP call's frame), or raise ApplicationError ``throttled`` (429) when
    PTC_EVENT_STREAMS_PER_USER are open in this process. Call it on the event loop: the count and
    the place taken with no await between them."""
    global _swept_at
    if len(_FOLLOWS) > 2 * _swept_at:  # the users who follow nothing now, forgotten: kept, they added up
        for idle in [user for user, held in _FOLLOWS.items() if not held]:
            del _FOLLOWS[idle]
        _swept_at = max(len(_FOLLOWS), FOLLOW_SWEEP_FROM)
    places = _FOLLOWS.setdefault(user_id, weakref.WeakSet())
    if len(places) >= settings.PTC_EVENT_STREAMS_PER_USER:
        raise ApplicationError(
            "throttled",
            f"You have {len(places)} event streams or MCP job calls open, the most one user may "
            "(PTC_EVENT_STREAMS_PER_USER): close one, or wait for one to end.",
            status=429,
            details={"limit": settings.PTC_EVENT_STREAMS_PER_USER, "retry_after": FOLLOW_RETRY_SECONDS},
        )
    place = FollowPlace()
    places.add(place)
    return place


# What a follower refused for its user's open follows waits before trying again.
FOLLOW_RETRY_SECONDS = 5


# -- Publishing (workers) ------------------------------------------------------------------------
def event_publish(*, job_call_id: str, event: str, data: dict[str, Any], expire: int | None = None) -> None:
    """Append an event to the job's stream. Never raises: a lost event must not fail the job."""
    events_publish(job_call_id=job_call_id, events=[(event, data)], expire=expire)


def events_publish(*, job_call_id: str, events: Events, expire: int | None = None) -> None:
    """Append events to the job's log in one round trip, in order (``expire``: the log's expiry,
    in seconds, unless its end is among them). Never raises."""
    backplane().events_append(job_call_id, events, expire=expire)


# An event of a job's: ``(job call_id, (name, data))``.
JobEvent = tuple[str, tuple[str, dict[str, Any]]]


def events_publish_by_job(events: list[JobEvent]) -> None:
    """Append events ``(job call_id, event)`` of any jobs to their logs, each job's in order, all in
    one round trip. Events of no job (``""``: a standalone call's) are left out. Never raises."""
    backplane().publish_then_append([], events_by_job(events))


def events_by_job(events: list[JobEvent]) -> JobsEvents:
    """Events ``(job call_id, event)`` as ``(job call_id, its events)``, each job's in order; those
    of no job (``""``) left out."""
    by_job: dict[str, Events] = {}
    for job_call_id, event in events:
        if job_call_id:
            by_job.setdefault(job_call_id, []).append(event)
    return list(by_job.items())


def output_events(output: Sequence[tuple[str, str]]) -> Events:
    """Text a job printed, ``(stream, text)``, as its events: ``stdout`` or ``stderr``, with the text."""
    return [(stream, {"text": text}) for stream, text in output]


def output_publish(*, job_call_id: str, output: Sequence[tuple[str, str]]) -> None:
    """Append what job ``job_call_id`` printed, ``(stream, text)``, to its events, in one round trip."""
    events_publish_by_job([(job_call_id, event) for event in output_events(output)])


def output_from_stream(*, job_call_id: str) -> dict[str, str]:
    """Return what a job printed (``stdout``, ``stderr``) as its live events carried it: for a job
    whose worker died before it could store the output. Empty without an event log."""
    parts: dict[str, list[str]] = {"stdout": [], "stderr": []}
    for _, name, data in backplane().events_read(job_call_id):
        if name in parts:
            parts[name].append(data["text"])
    return {name: "".join(texts) for name, texts in parts.items() if texts}


@functools.cache
def _serializer(name: str) -> Any:
    """One serializer of a kind from execution.serializers, its fields built once: building them is
    most of what serialising costs, on every tool call's and every job's path. ``to_representation``
    keeps no state, so threads may share it."""
    from execution import serializers

    return getattr(serializers, name)()


def tool_call_payload(call: ToolCall) -> dict[str, Any]:
    """The ToolCall as the API shows it, plus ``"ptc": true``: what every tool event carries."""
    return {**_serializer("ToolCallSerializer").to_representation(call), "ptc": True}


def tool_call_event(call: ToolCall) -> tuple[str, dict[str, Any]]:
    """Return the event name and payload for a call's current state."""
    name = "tool_call_error" if call.status == ToolCall.Status.FAILED else "tool_call_start"
    return "tool_call_end" if call.status == ToolCall.Status.COMPLETED else name, tool_call_payload(call)


def tool_call_pending_payload(call: ToolCall) -> dict[str, Any]:
    """What ``tool_call_pending`` carries for a call that waits on the job's caller or an approval:
    a ``tool_use`` block in the shape Anthropic's programmatic tool calling gives a client (``id`` is
    the call_id to answer with; ``caller.tool_id`` the job's call_id), plus ``awaiting``
    (``client`` or ``approval``), ``toolset`` and the ToolCall itself as ``call``."""
    return {
        "type": "tool_use",
        "id": call.call_id,
        "name": call.tool_name,
        "input": call.input,
        "caller": {"type": "code_execution", "tool_id": call.ptc_call_id},
        "awaiting": "approval" if call.status == ToolCall.Status.AWAITING_APPROVAL or call.decision else "client",
        "toolset": call.toolset_key,
        "call": tool_call_payload(call),
    }


def job_view(job: ExecJob) -> dict[str, Any]:
    """The job as the API shows it, code included: what its ``End`` pushes to whoever waits on it.
    ``job`` comes with its calls (``exec_job_with_calls``)."""
    return dict(_serializer("ExecJobSerializer").to_representation(job))


def job_end_payload(view: dict[str, Any]) -> dict[str, Any]:
    """What ``exec_end`` carries: the job's view without its code."""
    return {name: value for name, value in view.items() if name != "code"}


def job_start_payload(job: ExecJob) -> dict[str, Any]:
    return {
        "id": str(job.pk),
        "call_id": job.call_id,
        "status": "running",
        "title": job.title,
        "toolsets": job.toolsets,
        "started_at": job.started_at.isoformat() if job.started_at else None,
    }


# -- Reading (SSE, CLI) --------------------------------------------------------------------------
def event_filled(job_id: Any, name: str, data: dict[str, Any]) -> dict[str, Any]:
    """``data`` as it was written: an event the log keeps without its large fields (named in
    ``_omitted``: backplane.FROM_RECORDS) has them filled in from the records, which hold them as
    they were (a call's input; its output or error once it has ended; a job's view once it has)."""
    omitted = data.pop("_omitted", [])
    if not omitted:
        return data
    if name == "exec_end":
        try:
            full = job_end_payload(job_view(exec_job_with_calls(job_id=job_id)))
        except ExecJob.DoesNotExist:  # deleted since, with its user
            return data
    else:
        call = ToolCall.objects.filter(call_id=data.get("call_id") or data.get("id")).first()
        if call is None:  # deleted since
            return data
        full = tool_call_pending_payload(call) if name == "tool_call_pending" else tool_call_payload(call)
    for path in omitted:
        head, _, field = path.partition(".")
        whole = full.get(head)
        if field and isinstance(whole, dict) and isinstance(data.get(head), dict):
            data[head][field] = whole.get(field)
        else:  # or no longer an object: emptied by retention since (a log whose drop failed)
            data[head] = whole
    return data


def events_from_records(job_id: Any) -> tuple[list[Event], bool]:
    """Rebuild a job's events from its records, in order. Return them and whether the job ended."""
    job = ExecJob.objects.select_related("user").get(pk=job_id)
    timed: list[tuple[float, int, str, dict[str, Any]]] = []
    if job.started_at:
        timed.append((job.started_at.timestamp(), 0, "exec_start", job_start_payload(job)))
    for order, call in enumerate(job.tool_calls.select_related("tool__toolset").order_by("started_at", "id")):
        payload = tool_call_payload(call)
        timed.append((call.started_at.timestamp(), 1 + 4 * order, "tool_call_start", payload))
        if call.status in ToolCall.AWAITING or call.decision or tool_call_is_client(call):
            timed.append((call.started_at.timestamp(), 2 + 4 * order, "tool_call_pending", tool_call_pending_payload(call)))
        if call.decision == ToolCall.Decision.APPROVED and call.decided_at:
            timed.append((call.decided_at.timestamp(), 3 + 4 * order, "tool_call_approved", payload))
        if call.finished_at:
            name, _ = tool_call_event(call)
            timed.append((call.finished_at.timestamp(), 4 + 4 * order, name, payload))
    ended = job.status in ExecJob.FINISHED
    if ended:
        end = (job.finished_at or job.created_at).timestamp()
        timed.append(
            (
                max(end, *(t[0] for t in timed)) if timed else end,
                10**9,
                "exec_end",
                job_end_payload(job_view(exec_job_with_calls(job_id=job_id))),
            )
        )
    timed.sort(key=lambda t: (t[0], t[1]))
    events, last = [], (0, -1)
    for at, _, name, payload in timed:
        ms = int(at * 1000)
        key = (ms, 0) if ms > last[0] else (last[0], last[1] + 1)
        last = key
        events.append(Event(f"{key[0]}-{key[1]}", name, payload))
    return events, ended


async def _from_records(job_id: Any, after: str | None, *, offsets: bool = False) -> AsyncIterator[Event]:
    """Replay an ended job's events from its records (its log has expired), after ``after``: they
    no longer change, so their ids are the same at every replay.

    With ``offsets`` (the embedded log's ids are offsets in its file), an ``after`` less than any
    time the records give is an offset in the expired log: the records can't tell which events it
    had, and it gets the job's end only (an hour on, EventSource reconnecting from its end, or a
    log dropped as it was read), not the whole history again."""
    start = _order(after) if after else (-1, -1)
    events, _ = await db_read(events_from_records)(job_id)
    if offsets and events and (0, 0) < start < _order(events[0].id):
        events, start = events[-1:], (-1, -1)
    for event in events:
        if _order(event.id) > start:
            yield event


@db_read
def _job_state(job_id: Any) -> tuple[str, bool]:
    job = ExecJob.objects.values("call_id", "status").get(pk=job_id)
    return job["call_id"], job["status"] in ExecJob.FINISHED


# How long after a job's close its end may still be on its way to its log: the close is committed,
# then the end appended (milliseconds; a second or so for a job whose view is large).
END_LOST_SECONDS = 10.0


@db_read
def _end_lost(job_id: Any) -> dict[str, Any] | None:
    """The ``exec_end`` of a job closed over END_LOST_SECONDS ago, from its records: for a log that
    has none (its append was lost to a Redis away at that moment: nothing raises there, and the
    log's expiry, set with it, was lost too). None while it may still come: while its close has
    calls left to end, which it does before it announces the end (queued ones no worker took and
    waiting ones fail; those a tools worker runs are waited for, each until it is overdue). The
    close retries through a database outage, and ``closed_at`` is when the store of the end began,
    which retries too: past both, and past its calls' deadlines, the end is what the records say."""
    now = timezone.now()
    closed_at = ExecJob.objects.filter(pk=job_id).values_list("closed_at", flat=True).first()
    if closed_at is None or closed_at > now - timedelta(seconds=END_LOST_SECONDS):
        return None
    left = ToolCall.objects.filter(exec_job_id=job_id, status__in=ToolCall.OPEN)
    if left.exists():
        due = max(closed_at + timedelta(seconds=2 * settings.PTC_DB_RETRY_SECONDS), calls_overdue_at(left) or closed_at)
        if now < due + timedelta(seconds=END_LOST_SECONDS):
            return None
    return job_end_payload(job_view(exec_job_with_calls(job_id=job_id)))


# How far back from a cursor a job's end can be: past it the log has only the ends of the calls
# that outlived the job (at most the parallel cap's), and an end appended twice (by a reader that
# found it lost, and by its worker after all) or thrice.
END_WITHIN = BOUNDS["max_parallel_tool_calls"][1] * 2 + 100


async def _has_end(client: Any, key: str, cursor: str) -> bool:
    """Whether the log ``key`` has its ``exec_end`` at or before ``cursor``: a reader there has it
    all. It need not be the log's last entry: a call that outlived its job ends after it. Looked
    for within END_WITHIN entries of the cursor: paged back to the log's start, a reconnect to a
    long log whose end lay ahead took hundreds of round trips."""
    upto, seen = cursor, 0
    while seen < END_WITHIN and (entries := await client.xrevrange(key, max=upto, count=100)):
        if any(fields.get(b"event") == b"exec_end" for _, fields in entries):
            return True
        seen += len(entries)
        ms, seq = _order(entries[-1][0].decode())  # the page before this one, this one left out
        if (ms, seq) == (0, 0):
            break
        upto = f"{ms}-{seq - 1}" if seq else f"{ms - 1}-{2**64 - 1}"  # no "(" in a range before Redis 6.2
    return False


async def event_stream(*, job_id: Any, last_event_id: str | None = None) -> AsyncGenerator[Event | None, None]:
    """Yield the job's events after ``last_event_id`` as they happen, ending with ``exec_end``.

    ``None`` is a heartbeat, at least every PTC_EVENTS_HEARTBEAT_SECONDS, among the events too: a
    follower checks at each that its caller may still read (a key revoked meanwhile), and a job
    that prints more often than that never fell quiet, so a revoked key read it to its end.
    """
    every = settings.PTC_EVENTS_HEARTBEAT_SECONDS
    due = time.monotonic() + every
    async with aclosing(_events(job_id=job_id, last_event_id=last_event_id)) as events:
        async for item in events:
            if item is None or time.monotonic() >= due:
                due = time.monotonic() + every
                yield None
            if item is not None:
                yield item


async def _events(*, job_id: Any, last_event_id: str | None) -> AsyncGenerator[Event | None, None]:
    """The job's events after ``last_event_id``, and ``None`` when none came for a heartbeat's interval."""
    plane = backplane()
    if isinstance(plane, LocalBackplane):
        async for item in _from_file(plane, job_id=job_id, last_event_id=last_event_id):
            yield item
        return
    assert isinstance(plane, RedisBackplane)
    from redis.exceptions import RedisError

    call_id, ended = await _job_state(job_id)
    client = plane.async_client()
    key = plane.stream_key(call_id)
    try:
        if ended and not await client.exists(key):  # the stream expired: the records tell it
            async for item in _from_records(job_id, last_event_id):
                yield item
            return
        cursor = last_event_id or "0-0"
        if ended and last_event_id and await _has_end(client, key, cursor):
            return  # a reconnect after the end (EventSource makes one by itself): nothing is left
        live = False  # the first read is the backlog: its age is not lag
        while True:
            reply = await client.xread({key: cursor}, block=int(settings.PTC_EVENTS_HEARTBEAT_SECONDS * 1000), count=500)
            if not reply:
                # An ended job's end may still be on its way (a cancel is recorded before its
                # worker announces the end): wait for it, unless its log has expired meanwhile, or
                # its end is behind the cursor (a Last-Event-ID ahead of every event the job wrote).
                call_id, ended = await _job_state(job_id)
                if ended and not await client.exists(key):
                    async for item in _from_records(job_id, cursor):
                        yield item
                    return
                if ended and await _has_end(client, key, cursor):
                    return
                if ended and (end := await _end_lost(job_id)) is not None:
                    # Appended to the log, as its worker would have (with the log's expiry, lost
                    # with it), and read from there as any event: a reconnect from it finds it, and
                    # an end its worker appends after all (its close retried through a database
                    # outage) comes after it, never read. One read since (another reader's) is read.
                    pipe = client.pipeline(transaction=False)
                    if not await _has_end(client, key, "+"):
                        plane.events_into(pipe, [(call_id, [("exec_end", end)])])
                    pipe.expire(key, settings.PTC_EVENTS_RETENTION_SECONDS)
                    await pipe.execute()
                    continue
                yield None
                continue
            # RESP2, this client's protocol, answers as a list: [[key, [(id, {field: value}), ...]]], in
            # bytes. redis-py's type is the union with RESP3's dict, which only protocol=3 gives.
            assert isinstance(reply, list), "XREAD over RESP2 answers with a list"
            for raw_id, fields in reply[0][1]:
                cursor = raw_id.decode()
                if live:  # a stream entry's id is the Redis time it was written, in ms
                    event_lag_observe(written_ms=int(cursor.split("-", 1)[0]))
                name = fields[b"event"].decode()
                data = json.loads(fields[b"data"])
                if "_omitted" in data:  # logged without its large fields: the records have them
                    data = await db_read(event_filled)(job_id, name, data)
                yield Event(cursor, name, data)
                if name == "exec_end":
                    return
            live = True
    except RedisError:
        # Redis went away mid-stream: end it; the client reconnects with Last-Event-ID and resumes.
        logger.warning("event stream cut: Redis is unreachable", extra={"job_id": str(job_id)}, exc_info=True)
    finally:
        await client.aclose()


async def _from_file(plane: LocalBackplane, *, job_id: Any, last_event_id: str | None) -> AsyncGenerator[Event | None, None]:
    """``_events`` on the embedded backplane: the job's log file, read from the offset its last
    event id names, woken by the job's channel as it grows."""
    call_id, ended = await _job_state(job_id)
    cursor = _order(last_event_id)[0] if last_event_id else 0
    last = last_event_id  # the last id the reader has
    if ended and last_event_id and (end_at := await asyncio.to_thread(plane.events_end_at, call_id)) is not None:
        if end_at <= cursor:
            # A reconnect after the end (EventSource makes one by itself): nothing is left. What
            # the log has after its end (an end its worker appended after a reader took it from
            # the records; a call that outlived its job) that reader was never to be sent.
            return
    # Subscribed before the first read: an append after it wakes this reader.
    with await sync_to_async(plane.subscribe)(job_channel(call_id)) as subscription:
        while True:
            read = await asyncio.to_thread(plane.events_after, call_id, cursor)
            if read is None and ended:  # expired (or never written): the records tell it
                async for event in _from_records(job_id, last, offsets=True):
                    yield event
                return
            for event_id, name, data in read[0] if read else []:
                if "_omitted" in data:  # logged without its large fields: the records have them
                    data = await db_read(event_filled)(job_id, name, data)
                yield Event(event_id, name, data)
                last = event_id
                if name == "exec_end":
                    return
            if read and read[1] > cursor:  # events, or lines skipped as torn: never read again
                cursor = read[1]
                continue
            if ended:
                # Its end is behind the cursor (a reconnect after it), or on its way (a cancel is
                # recorded before its worker announces the end), or lost (its worker died as it
                # appended it): then appended from the records, as its worker would have.
                end_at = await asyncio.to_thread(plane.events_end_at, call_id)
                if end_at is not None and end_at <= cursor:
                    return
                if end_at is None and (end := await _end_lost(job_id)) is not None:
                    await asyncio.to_thread(plane.events_append, call_id, [("exec_end", end)])
                    if await asyncio.to_thread(plane.events_end_at, call_id) is None:
                        # Not appended either (the disk that lost it is full, and events_append
                        # never raises): sent from the records, not looked for again at once.
                        async for event in _from_records(job_id, last, offsets=True):
                            yield event
                        return
                    continue
            await subscription.wait_async(settings.PTC_EVENTS_HEARTBEAT_SECONDS)
            if not subscription.drain():
                yield None  # a heartbeat
                _, ended = await _job_state(job_id)
