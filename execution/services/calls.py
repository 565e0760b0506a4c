"""Writes for tool calls, from birth to charge: check, record, reserve, enqueue, claim, run,
finish (settling or releasing the credits held), and the reaper of calls whose worker died."""

import copy
import functools
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, TypeVar, cast

from django.conf import settings
from django.contrib.auth.models import User
from django.core import signing
from django.db import InterfaceError, OperationalError, connection, transaction
from django.db.models import Exists, OuterRef, Prefetch, Subquery
from django.db.models.functions import Coalesce
from django.utils import timezone

from billing.ledger import PostgresLedger
from billing.models import Reservation
from billing.selectors import credits_held, reservations_held
from billing.services import (
    credits_close_many,
    credits_release,
    credits_reserve,
    credits_settle,
    credits_settle_many,
    price_quote,
)
from execution.backplane import (
    Admitted,
    Answer,
    Ask,
    Message,
    RedisBackplane,
    Released,
    Result,
    backplane,
    call_channel,
    job_channel,
    logged_whole,
)
from execution.events import (
    JobEvent,
    event_publish,
    events_by_job,
    events_publish_by_job,
    tool_call_event,
    tool_call_payload,
    tool_call_pending_payload,
)
from execution.models import ExecJob, ToolCall
from execution.sandbox.limits import CALL_GRACE_SECONDS
from execution.services.quotas import tool_call_quota_check
from ptcproject import rows
from ptcproject.accounts.models import ApiKey
from ptcproject.batching import GroupCommit
from ptcproject.broker import Channel as BrokerChannel
from ptcproject.broker import broker_trouble, publish_riding
from ptcproject.celery import task_publish
from ptcproject.db import (
    LockedRows,
    brief_lock_wait,
    brief_lock_wait_sql,
    db_reset,
    db_retry,
    lock_wait_brief,
    statement_cancelled,
    unless_cancelled,
    unless_locked,
)
from ptcproject.errors import ApplicationError, call_error
from ptcproject.metrics import tool_call_observe
from ptcproject.policy.models import Policy
from ptcproject.policy.selectors import policy_get, quotas_for
from ptcproject.storage import MAX_JSON_DEPTH, json_depth_exceeds, storable, unstorable
from tools.arguments import arguments_error, arguments_validator
from tools.classification import tool_is_ptc
from tools.client import CLIENT_KEY
from tools.errors import ToolFailure
from tools.kinds import tool_run
from tools.models import Tool, Toolset
from tools.selectors import tool_for_call, tool_timeout_or_default, toolsets_resolve

logger = logging.getLogger("ptc.execution")
T = TypeVar("T")


# -- Tool calls ----------------------------------------------------------------------------------
class CallChecker:
    """Checks one tool call before it runs: toolset granted, tool known (and callable from code when
    ``ptc_only``), arguments valid against the tool's JSON Schema. Validators are kept per tool."""

    def __init__(
        self,
        *,
        user: User,
        toolsets: list[Toolset],
        direct_only: frozenset[str],
        ptc_only: bool,
        extra: list[tuple[Toolset, list[Tool]]] | None = None,
    ) -> None:
        self.user = user
        self.toolsets = {ts.key: ts for ts in toolsets}
        # Unsaved toolsets with their tools (a job's client tools): no ``tools.all()`` to ask.
        self.extra_tools = {ts.key: tools for ts, tools in extra or []}
        self.toolsets.update({ts.key: ts for ts, _ in extra or []})
        self.direct_only = direct_only
        self.ptc_only = ptc_only
        self.validators: dict[Any, Any] = {}

    def check(self, toolset_key: str, tool_name: str, arguments: Any) -> Tool:
        """Return the tool to run, or raise ToolFailure with a stable code."""
        toolset = self.toolsets.get(toolset_key)
        if toolset is None:
            if toolset_key == CLIENT_KEY:
                # A session's globals keep the Client class of an earlier job that had client tools.
                raise ToolFailure(
                    "unknown_toolset",
                    "this job has no client tools: list them in its request's client_tools "
                    "(an earlier job's in the session were that job's only)",
                )
            if toolsets_resolve(user=self.user, keys=[toolset_key])[0]:
                raise ToolFailure("toolset_not_granted", f"toolset '{_quoted(toolset_key)}' was not granted to this job")
            raise ToolFailure("unknown_toolset", f"there is no toolset '{_quoted(toolset_key)}'")
        tools = self.extra_tools[toolset_key] if toolset_key in self.extra_tools else toolset.tools.all()
        tool = next((t for t in tools if t.name == tool_name), None)
        if tool is None:
            raise ToolFailure("unknown_tool", f"toolset '{toolset_key}' has no tool '{_quoted(tool_name)}'")
        if self.ptc_only and not tool_is_ptc(tool=tool, toolset=toolset, direct_only=self.direct_only):
            raise ToolFailure("tool_not_ptc", f"'{toolset_key}.{tool_name}' is a direct tool and cannot be called from code")
        if not isinstance(arguments, dict):
            raise ToolFailure("invalid_arguments", "arguments must be a JSON object of keyword arguments")
        if json_depth_exceeds(arguments):  # before the schema: its validator recurses
            raise ToolFailure("invalid_arguments", f"arguments nest deeper than {MAX_JSON_DEPTH} levels")
        problem = unstorable(arguments)  # the tool gets its arguments as recorded: never altered to fit
        if problem:
            raise ToolFailure("invalid_arguments", _quoted(problem))
        validator = self.validators.get(tool.pk)
        if validator is None:
            validator = self.validators[tool.pk] = arguments_validator(tool.input_schema)
        error = arguments_error(validator, arguments)  # or ToolFailure, for a schema that can't be checked
        if error is not None:
            where = "/".join(str(p) for p in error.absolute_path) or "arguments"
            raise ToolFailure("invalid_arguments", _quoted(f"{where}: {error.message}"))
        return tool


# What of the code's own input a refusal quotes: jsonschema's message holds the repr of the value
# it refused, and a name or a value may be as long as a call frame. The message went whole to the
# code, the call's record and its events.
_QUOTED_HEAD, _QUOTED_TAIL = 200, 100


def _quoted(text: str) -> str:
    """Return ``text`` as an error quotes it: whole up to 300 characters, else its start and its end
    (where jsonschema says why: "... is not of type 'number'")."""
    if len(text) <= _QUOTED_HEAD + _QUOTED_TAIL:
        return text
    return f"{text[:_QUOTED_HEAD]}…{text[-_QUOTED_TAIL:]}"


def tool_call_build(
    *,
    call_id: str,
    user: User,
    job: ExecJob | None,
    toolset: str,
    tool: str,
    arguments: Any,
    found: Tool | None,
    error: dict[str, str] | None = None,
    status: str = ToolCall.Status.EXECUTING,
    caller: dict[str, str] | None = None,
) -> ToolCall:
    """Return the call's record, unsaved: ``status`` (``executing``, or awaiting its client or an
    approval), or ``failed`` already if it was refused. A job's own client tool has no row to link."""
    now = timezone.now()
    if found is not None and found._state.adding:
        found = None
    return ToolCall(
        call_id=call_id,
        type=ToolCall.Type.PTC if job else ToolCall.Type.STANDALONE,
        exec_job=job,
        ptc_call_id=job.call_id if job else "",
        user=user,
        toolset_key=storable(toolset[:64]),  # as the code named them, NUL and all
        tool_name=storable(tool[:128]),
        tool=found,
        input=storable(arguments if isinstance(arguments, dict) else {"value": arguments}),
        status=ToolCall.Status.FAILED if error else status,
        error=storable(error),  # its message may quote what the code sent (a tool's name, a key)
        started_at=now,
        finished_at=now if error else None,
        caller=caller,
    )


def tool_calls_record(
    calls: list[ToolCall], *, queued: frozenset[str] = frozenset(), starts_held: bool = False
) -> tuple[frozenset[str], list[JobEvent]]:
    """Write records before their calls run, in one INSERT, and publish their start events (and the
    errors of refused ones) in one round trip. The ``queued`` calls are announced but not written:
    a job's calls for a tools worker are recorded by the statement that claims them (``execute_tool``
    carries the record), which saves the bridge a statement on every call's path. Those whose start
    the event log keeps without its large input are written here all the same: its readers fill it
    in from the record, at once (a live reader got it with no input, before any worker took the
    call). Return those (they are queued as recorded calls, without their record), and with
    ``starts_held`` the queued calls' start events, not published: ``tool_calls_enqueue`` sends
    them with their messages."""
    starts = {call.call_id: tool_call_payload(call) for call in calls if call.ptc_call_id}
    written = frozenset(
        call_id for call_id in queued if call_id in starts and not logged_whole("tool_call_start", starts[call_id])
    )
    rows = [call for call in calls if call.call_id not in queued or call.call_id in written]
    if len(rows) == 1:
        # One row is one INSERT in autocommit; bulk_create would wrap it in BEGIN and COMMIT, two
        # round trips more on every sequential call's path.
        rows[0].save(force_insert=True)
    elif rows:
        ToolCall.objects.bulk_create(rows)
    events: list[JobEvent] = []
    held: list[JobEvent] = []
    for call in calls:
        if call.ptc_call_id:
            start: JobEvent = (call.ptc_call_id, ("tool_call_start", starts[call.call_id]))
            (held if starts_held and call.call_id in queued else events).append(start)
            if call.status in ToolCall.AWAITING:
                events.append((call.ptc_call_id, ("tool_call_pending", tool_call_pending_payload(call))))
            if call.status == ToolCall.Status.FAILED:
                events.append((call.ptc_call_id, tool_call_event(call)))
    if events:
        events_publish_by_job(events)
    return written, held


# What a queued call's message carries to the worker that claims it: the record's fields, signed
# with the deployment's SECRET_KEY, so that what reaches the broker can't make up a call.
_QUEUED_SIGNER = signing.Signer(salt="ptc.execute_tool.record")
_QUEUED_ATTNAMES = ("call_id", "type", "exec_job_id", "ptc_call_id", "user_id", "toolset_key", "tool_name", "tool_id", "input")


def tool_call_signed(call: ToolCall) -> str:
    """Return the record of a queued call as its tools task takes it: JSON, signed."""
    fields: dict[str, Any] = {name: getattr(call, name) for name in _QUEUED_ATTNAMES}
    fields["started_at"] = call.started_at.isoformat()
    for name in ("exec_job_id", "tool_id"):
        fields[name] = None if fields[name] is None else str(fields[name])
    return _QUEUED_SIGNER.sign(json.dumps(fields, separators=(",", ":")))


def _unverified_job(record: str) -> str:
    """The job a record whose signature failed names, to address an error to (never trusted more)."""
    try:
        job = json.loads(record.rsplit(":", 1)[0]).get("ptc_call_id")
    except (ValueError, AttributeError):
        return ""
    return job if isinstance(job, str) else ""


def _tool_call_unsigned(record: str) -> ToolCall | None:
    """Return the unsaved record a queued call's message carries, or None if its signature is bad."""
    try:
        fields = json.loads(_QUEUED_SIGNER.unsign(record))
    except signing.BadSignature:
        return None
    fields["started_at"] = datetime.fromisoformat(fields["started_at"])
    for name in ("exec_job_id", "tool_id"):
        fields[name] = None if fields[name] is None else uuid.UUID(fields[name])
    return ToolCall(**fields, status=ToolCall.Status.EXECUTING)


def _tool_call_record(**fields: Any) -> ToolCall:
    call = tool_call_build(**fields)
    tool_calls_record([call])
    return call


def _tool_call_event_publish(call: ToolCall) -> None:
    if call.ptc_call_id:
        name, data = tool_call_event(call)
        event_publish(job_call_id=call.ptc_call_id, event=name, data=data)


def tool_calls_enqueue(
    calls: list[tuple[str, str]], *, queued: dict[str, ToolCall] | None = None, starts: list[JobEvent] | None = None
) -> dict[str, dict[str, str]]:
    """Send calls ``(call_id, queue)`` to their toolset's tools queue through one producer, a burst
    in one round trip (kombu's publish batch, on Redis). The ``queued`` ones (by call id: unsaved
    records) go with their record, which their worker writes as it claims them. Their ``starts``
    (``(job call_id, event)``, held by ``tool_calls_record``) are in their jobs' logs before any
    worker can take them, and so before the worker's end events: a lone call's in the round trip of
    its message, when the backplane's Redis is the broker's (``publish_riding``); else before it is
    sent, in a round trip of their own. Return the errors of those that failed (their records are
    failed too): the broker was down even after the publish retries.

    A batch that fails fails all its calls: some of its messages may have reached the queue, but
    their records are failed first (or a worker that took one already finds it failed when it
    finishes), so what the code is told is what the records say, and nothing is charged.
    """
    from execution.tasks import execute_tool

    queued = queued or {}
    errors = {}
    starts_by_job = events_by_job(starts or [])
    with execute_tool.app.producer_or_acquire() as producer:
        sent: Callable[[], bool] | None = None  # whether the starts went with the message
        try:
            riding = bool(starts_by_job) and len(calls) == 1 and _starts_ride(producer)
            if starts_by_job and not riding:
                backplane().publish_then_append([], starts_by_job)
                starts_by_job = []
            with ExitStack() as block:
                # A lone message is sent at once, under the publish retries; a burst is sent when the
                # block ends, in one pipeline, not retried (a replay could queue a call twice).
                if len(calls) > 1:
                    block.enter_context(producer.batch())
                elif riding:
                    redis_backplane = cast(RedisBackplane, backplane())
                    sent = block.enter_context(publish_riding(lambda pipe: redis_backplane.events_into(pipe, starts_by_job)))
                for call_id, queue in calls:
                    record = tool_call_signed(queued[call_id]) if call_id in queued else None
                    args = (call_id,) if record is None else (call_id, record)
                    # The worker's log shows the call id only, never the record (it holds the call's input).
                    task_publish(execute_tool, producer, args, queue=queue, retry=len(calls) == 1, argsrepr=repr((call_id,)))
        except Exception as exc:
            if starts_by_job and not (sent and sent()):  # they never reached Redis: before the failures' events
                backplane().publish_then_append([], starts_by_job)
            logger.exception("could not enqueue tool calls", extra={"call_ids": [call_id for call_id, _ in calls]})
            error = call_error("broker_unavailable", f"the call could not be queued: the broker {broker_trouble(exc)}; retry")
            errors = {call_id: error for call_id, _ in calls}

            def fail() -> None:
                tool_calls_fail_queued([queued[call_id] for call_id, _ in calls if call_id in queued], error=error, running=True)
                for call_id, _ in calls:
                    if call_id not in queued:
                        tool_call_finish(call_id=call_id, error=error)

            # Their failure is written before the code is told, even when its statement is the first
            # on a pooled connection that turns out dead (calls only announced so far have no other):
            # it is written again on a fresh one, so that a message that did reach the queue finds
            # its call failed rather than run it unrecorded. (Both statements change only open calls.)
            try:
                fail()
            except (OperationalError, InterfaceError):
                db_reset()
                fail()
    return errors


def _starts_ride(producer: Any) -> bool:
    """Whether calls' start events can go to Redis in the round trip of their message: the
    backplane's Redis is the broker's, and the message goes through our transport."""
    return (
        settings.REDIS_URL == settings.CELERY_BROKER_URL
        and isinstance(backplane(), RedisBackplane)
        and isinstance(producer.channel, BrokerChannel)
    )


def tool_calls_fail_queued(calls: list[ToolCall], *, error: dict[str, str], running: bool) -> list[str]:
    """Record queued calls (unsaved: their worker writes their record as it claims them) as failed
    with ``error``, in one statement: those no worker has claimed, and with ``running`` those still
    running too (their worker's result is then dropped, as for any call ended before its result).
    Release what was held for each one failed here and publish its end. Return their call ids."""
    if not calls:
        return []
    now = timezone.now()
    failed = []
    for call in calls:
        row = copy.copy(call)
        row.status, row.error, row.finished_at = ToolCall.Status.FAILED, storable(error), now
        failed.append(row)
    placeholders = ", ".join([f"({_row_values()})"] * len(failed))
    unclaimed = "" if running else f"AND {ToolCall._meta.db_table}.claimed_at IS NULL"
    sql = _FAIL_QUEUED_SQL.format(rows=placeholders, unclaimed=unclaimed)
    params = [value for row in failed for value in rows.prepared(row, _ROW_FIELDS)]
    # Their holds given back in the transaction that fails them: given back after, one whose
    # account's row was held locked (a statement cancelled: the reaper's brief wait, the statement
    # timeout) failed the work with the calls failed and the holds of the rest not given back either,
    # and the work done again found nothing left to fail: every hold stayed until the reaper's close
    # of held credits, a lease later.
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute(sql, params)
            ended = {call_id for (call_id,) in cursor.fetchall()}
        _holds_close([(row.user_id, row.call_id, False) for row in failed if row.call_id in ended])
    events_publish_by_job([(row.ptc_call_id, tool_call_event(row)) for row in failed if row.call_id in ended])
    return [row.call_id for row in failed if row.call_id in ended]


def _holds_close(calls: list[tuple[int, str, bool]]) -> None:
    """Settle (``True``) or give back (``False``) what was held for calls ``(user_id, call_id,
    settles)`` that ended in the caller's transaction, a statement per user, in the order of their
    users: two transactions that close holds of the same users never wait on each other in a cycle."""
    by_user: dict[int, tuple[list[str], list[str]]] = {}
    for user_id, call_id, settles in calls:
        by_user.setdefault(user_id, ([], []))[0 if settles else 1].append(call_id)
    for user_id in sorted(by_user):
        settled, released = by_user[user_id]
        credits_close_many(settle=settled, release=released)


def _tool_call_enqueue(*, call_id: str, queue: str) -> dict[str, str] | None:
    return tool_calls_enqueue([(call_id, queue)]).get(call_id)


def tool_call_standalone(
    *,
    user: User,
    key: ApiKey | None,
    toolset: str,
    tool: str,
    arguments: Any,
    job_call_id: str = "",
    container_id: str = "",
    caller: dict[str, str] | None = None,
) -> ToolCall:
    """Run one call outside any sandbox (POST /api/v1/tools/execute) and return its finished record.

    With a user key it is a ``standalone`` call (with a job's call_id too: ``call_id_mismatch``,
    403). With a job-scoped key and the job's call_id, it is a ``ptc`` call of that job, held by its
    bridge to what the job was granted as it started and to its limits. With ``container_id`` (a provider's own
    container running the code), it is a ``ptc`` call of that container's job, made on its first
    call that names a toolset and tool it may call: a request refused as it is checked makes none.
    ``caller`` (``{type, tool_id}``) is recorded as given. A tool that fails still returns its
    record (``failed``); a request that names no such toolset or tool raises ApplicationError, and
    so does a call that needs an approval or a client (``approval_required``, ``kind_unsupported``):
    only a job's sandbox waits for those. So does, with nothing recorded, a call without a job's key
    past the user's quota of calls in flight or, a new container's, past PTC_MAX_CONTAINERS_PER_USER
    (``rate_limited``, 429), and a container's whose job has ended (``job_finished``, 409).
    """
    job: ExecJob | None = None
    if job_call_id and (key is None or key.exec_job_id is None):
        # A job's call is made with that job's own key only: one made with a user's key would run
        # as a standalone call, outside the job's toolsets and limits, and the caller never know.
        raise ApplicationError(
            "call_id_mismatch",
            "A user's key cannot make a job's call: x-ptc-call-id is sent with the job-scoped key of the job it names "
            "(its code's key). Without the header, this key makes a standalone call.",
            status=403,
        )
    if key is not None and key.exec_job_id is not None:
        job = ExecJob.objects.select_related("user").get(pk=key.exec_job_id)
        if job_call_id != job.call_id:
            raise ApplicationError(
                "call_id_mismatch", "x-ptc-call-id must be the call_id of the job this key belongs to.", status=403
            )
        if toolset not in job.toolsets:
            raise ApplicationError(
                "toolset_not_granted", f"Toolset '{toolset}' was not granted to job {job.call_id}.", status=403
            )
    policy = policy_get()
    of_job = job is not None or bool(container_id)
    call_id = f"ptc_{uuid.uuid4().hex}" if of_job else f"standalone_{uuid.uuid4().hex}"
    made = _Making(call_id=call_id, user=user, policy=policy, of_job=of_job)
    if job is None:
        return _tool_call_made(
            made, job=None, toolset=toolset, tool=tool, arguments=arguments, container_id=container_id, caller=caller
        )
    # A remote sandbox's call (a job-scoped key) is held to the job's limits by the job's bridge,
    # which counts its code's calls (those still queued, with no record yet, among them) and these
    # together, and admits them one at a time: the two ways never pass the job's max_tool_calls or
    # its parallel cap in all. It calls the tool its job was granted as it started, as its code's
    # calls do: the bridge names it (a toolset disabled or made private since is then the tools
    # worker's to refuse, or to run, for both alike).
    # tool_call_limit, parallel_limit, job_ended; toolset_not_granted, unknown_tool, kind_unsupported
    made.granted, made.epoch = _job_call_ask(job=job, call_id=call_id, toolset=toolset, tool=tool)
    try:
        while True:
            try:
                return _tool_call_made(
                    made, job=job, toolset=toolset, tool=tool, arguments=arguments, container_id="", caller=caller
                )
            except _AdmissionLapsed:
                # Slower to record it than its bridge waits (two heartbeats): the bridge gave it up,
                # counted no more, and nothing was recorded. It asks again, as a new call would.
                made.granted, made.epoch = _job_call_ask(job=job, call_id=call_id, toolset=toolset, tool=tool)
    finally:
        # Its slot of the job's parallel cap is free (the bridge's deadline frees it should this
        # push be lost); refused before it was recorded, it is no call of the job's count either.
        released = Released(call_id=call_id, tool_bytes=made.tool_bytes, counted=made.recorded)
        backplane().publish(job_channel(job.call_id), released)


@dataclass
class _Making:
    """A call over POST /tools/execute as it is made: ``granted``, for a job's key, the id of the tool
    of the job's grant its bridge named; ``recorded`` once it is, and what its job's calls over
    HTTP passed (``tool_bytes``) as last counted."""

    call_id: str
    user: User
    policy: Policy
    of_job: bool
    granted: str = ""
    epoch: int = 0
    recorded: bool = False
    tool_bytes: int = 0


class _AdmissionLapsed(Exception):
    """The job's bridge admitted a call over HTTP under an ``http_admit_epoch`` it has since raised:
    it no longer counts the call, which must not be recorded (``_job_call_admit``)."""


def _tool_call_made(
    made: _Making,
    *,
    job: ExecJob | None,
    toolset: str,
    tool: str,
    arguments: Any,
    container_id: str,
    caller: dict[str, str] | None,
) -> ToolCall:
    """Check, record, run and return the call ``tool_call_standalone`` takes (its job's bridge has
    admitted it, for a job's key: raise _AdmissionLapsed, nothing recorded, if it no longer does)."""
    user, policy, call_id = made.user, made.policy, made.call_id
    if job is not None:
        found_toolsets = _granted_toolsets(tool_id=made.granted, toolset=toolset)
    else:
        found_toolsets, _ = toolsets_resolve(user=user, keys=[toolset])
    checker = CallChecker(
        user=user, toolsets=found_toolsets, direct_only=frozenset(policy.direct_only_tools), ptc_only=made.of_job
    )
    found: Tool | None = None
    error = None
    if job is not None and not found_toolsets:
        # Deleted since the job started: recorded failed, as its code's call of it is by its tools worker.
        error = call_error("unknown_tool", TOOL_GONE)
    else:
        try:
            found = checked = checker.check(toolset, tool, arguments)
            if checked.toolset.kind == Toolset.Kind.CLIENT:
                raise ApplicationError(
                    "kind_unsupported",
                    f"'{toolset}.{tool}' is a client tool: its caller runs it; there is nothing to run here.",
                    status=400,
                )
            if tool_needs_approval(tool=checked, policy=policy):
                raise ApplicationError(
                    "approval_required",
                    f"'{toolset}.{tool}' needs an approval before each call; call it from a job's code, where it waits for one.",
                    status=403,
                )
        except ToolFailure as failure:
            if failure.code == "unknown_toolset" and toolset == CLIENT_KEY:
                # Not the sandbox's word (list them in the job's client_tools): no job's code made this call.
                raise ApplicationError(
                    failure.code,
                    f"There is no toolset '{CLIENT_KEY}' to call here: a job's client tools are called from that job's code, "
                    "and run by its client.",
                ) from None
            if failure.code in ("unknown_toolset", "unknown_tool"):
                raise ApplicationError(failure.code, f"{failure.message[:1].upper()}{failure.message[1:]}.") from None
            if failure.code == "tool_not_ptc":
                raise ApplicationError(failure.code, f"{failure.message[:1].upper()}{failure.message[1:]}.", status=403) from None
            found, error = None, failure.as_dict()
    admit = job is not None
    # A call with no job's key (standalone, or a managed container's) has no parallel cap of ours:
    # it is held to the user's quota of calls in flight, counted under a lock on the user's row
    # until it is recorded, so calls at once are counted one by one. (A job's key is held to its
    # job's cap, which the same quota sets when the job is submitted: Quotas.parallel_cap.)
    quotas = None if job is not None else quotas_for(policy=policy, user=user)
    counted = quotas is not None and quotas.concurrent_tool_calls > 0
    container_job = None
    # A container's call is recorded under its job row's lock (exec_job_for_container), for the reaper.
    with transaction.atomic() if admit or counted or container_id else nullcontext():
        if counted:
            assert quotas is not None
            tool_call_quota_check(user=user, quotas=quotas)  # rate_limited (429): nothing recorded, no job made
        if container_id:
            from execution.services.jobs import exec_job_for_container  # which imports this module

            job = container_job = exec_job_for_container(user=user, container_id=container_id)
        # A container's calls have no parallel cap: each holds room for the largest result a call may
        # have until its own has come, or calls made at once all passed on what was counted before any
        # result came, and took the job past the bound by as many results. So it is passed by one call's
        # at most, as by calls one at a time. (A job's key is held to its parallel cap, as its bridge.)
        reserve = settings.PTC_MAX_TOOL_OUTPUT_BYTES if container_job is not None else 0
        if admit:
            assert job is not None
            _job_call_admit(job=job, epoch=made.epoch)
        if job is not None:
            made.tool_bytes = _job_bytes_take(job=job, size=CALL_RECORD_BYTES + _json_bytes(arguments), reserve=reserve)
        call = _tool_call_record(
            call_id=call_id,
            user=user,
            job=job,
            toolset=toolset,
            tool=tool,
            arguments=arguments,
            caller=caller,
            found=found,
            error=error,
        )
    made.recorded = True
    if admit:
        assert job is not None
        # Its bytes count with its code's in the job's sandbox; its slot is held as long as it is waited for.
        timeout = tool_run_timeout(found) if found is not None else 0.0
        backplane().publish(job_channel(job.call_id), Admitted(call_id=call_id, tool_bytes=made.tool_bytes, timeout=timeout))
    if found is not None:
        _standalone_run(call_id=call_id, found=found, user=user, job=job)
    call = ToolCall.objects.get(call_id=call_id)
    if job is not None:  # (a call that raised on its way here keeps the room it held: its result may still come)
        # The call has run and is charged: its answer is its record. The job's row held locked past
        # PTC_DB_STATEMENT_TIMEOUT (a transaction stuck elsewhere) cancelled this, and the request
        # answered 503 "try again": the retry ran the tool, and charged it, twice. Skipped so, the
        # job keeps the room held for the result, more than it took.
        size = _json_bytes(call.output) + _json_bytes(call.error) - reserve
        taken = unless_cancelled(
            lambda: _job_bytes_take(job=job, size=size, held=False),
            what="counting a call's result in its job's bytes",
            job_id=str(job.pk),
            call_id=call_id,
        )
        made.tool_bytes = max(made.tool_bytes, taken or 0)
    return call


def _granted_toolsets(*, tool_id: str, toolset: str) -> list[Toolset]:
    """The toolset of the tool ``tool_id`` (of the job's grant, as its bridge named it) with that
    tool, as they are now (none if it was deleted since): one disabled since is queued all the same,
    and its tools worker refuses it ``tool_disabled``, as it does the job's code's calls."""
    tools = Prefetch("tools", queryset=Tool.objects.filter(pk=tool_id))
    return list(Toolset.objects.filter(key=toolset, tools__pk=tool_id).prefetch_related(tools)) if tool_id else []


def _standalone_unheld(*, call_id: str, exc: Exception) -> None:
    """Fail a recorded call whose price could not be held (the database away, or its statement
    cancelled: the account's row held locked past PTC_DB_STATEMENT_TIMEOUT), before its request
    answers 503: nothing was held, queued or run, and a record left executing held a place in the
    user's quota of calls in flight (and its job's bytes) until the reaper abandoned it, twice the
    tool timeout later, refusing the retry the 503 asks for. Left to the reaper if the database
    can't be reached for this either."""
    why = "cancelled a statement" if statement_cancelled(exc) else "could not be reached"
    error = call_error("database_unavailable", f"the database {why} as the call's price was held; it was not run: retry")
    try:
        db_reset()
        tool_call_finish(call_id=call_id, error=error)
    except (OperationalError, InterfaceError):
        logger.warning("a call whose price could not be held is left to the reaper", extra={"call_id": call_id})


def _standalone_run(*, call_id: str, found: Tool, user: User, job: ExecJob | None) -> None:
    """Hold the recorded call's price, queue it and wait for its end (or end it ``tool_timeout``)."""
    try:
        refused = tool_calls_reserve(calls=[(call_id, found)], user=user, job=job)
    except (OperationalError, InterfaceError) as exc:
        _standalone_unheld(call_id=call_id, exc=exc)
        raise
    for error in refused.values():
        tool_call_finish(call_id=call_id, error=error)
    if not refused and _tool_call_enqueue(call_id=call_id, queue=found.toolset.queue) is None:
        timeout = tool_run_timeout(found) + CALL_GRACE_SECONDS
        finished = backplane().wait_for(
            _result_channel(call_id, job.call_id if job else ""),
            done=lambda: ToolCall.objects.filter(call_id=call_id).exclude(status=ToolCall.Status.EXECUTING).exists(),
            match=lambda message: isinstance(message, Result) and message.call_id == call_id,
            timeout=timeout,
        )
        if not finished:
            tool_call_finish(call_id=call_id, error=call_error("tool_timeout", CALL_TIMEOUT_MESSAGE))


# What a call's record adds to its job's view besides its arguments and result: its other fields as
# the API writes them (ids, names, times, status; under 500 bytes), so that many small calls count.
CALL_RECORD_BYTES = 512


def _json_bytes(value: Any) -> int:
    """``value``'s size in JSON, escaped to ASCII: never less than the view's UTF-8 takes."""
    return 0 if value is None else len(json.dumps(value, default=str))


def _job_bytes_take(*, job: ExecJob, size: int, held: bool = True, reserve: int = 0) -> int:
    """Add ``size`` (and ``reserve``, room held for a result to come) to what ``job``'s calls over
    HTTP passed, and return the new total, in one statement (which, for a managed container's job,
    also sets its ``last_call_at`` to now). With ``held`` (a call about to be
    recorded), raise ApplicationError ``tool_bytes_limit`` (403) instead if ``size`` would pass
    PTC_MAX_JOB_TOOL_BYTES: nothing is added. A result is added as it came (the next call is refused)."""
    most = settings.PTC_MAX_JOB_TOOL_BYTES if held else 0
    used: list[Any] = []
    if job.container_id:
        # A managed container's job was used now (a call recorded, or returned): the reaper's idle
        # close reads this, not the calls. Set in this statement, which runs anyway; never back.
        now = connection.ops.adapt_datetimefield_value(timezone.now())
        used = [now, now]
    with connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE {rows.table(ExecJob)} SET http_tool_bytes = http_tool_bytes + %s"  # noqa: S608 - names from the model
            + (
                ", last_call_at = CASE WHEN last_call_at IS NULL OR last_call_at < %s THEN %s ELSE last_call_at END"
                if used
                else ""
            )
            + " WHERE id = %s AND (%s = 0 OR http_tool_bytes + %s <= %s) RETURNING http_tool_bytes",
            [size + reserve, *used, ExecJob._meta.pk.get_db_prep_value(job.pk, connection), most, size, most],
        )
        found = cursor.fetchone()
    if found is None and not held:
        return 0  # its job was deleted meanwhile
    if found is None:
        raise ApplicationError(
            "tool_bytes_limit",
            f"Job {job.call_id}'s tool calls have passed {settings.PTC_MAX_JOB_TOOL_BYTES} bytes of arguments and "
            "results in all (PTC_MAX_JOB_TOOL_BYTES), the most one job's may: every view of the job carries them. "
            + (
                "Cancel this container's job and call from a new container."
                if job.container_id
                else "Pass less through tools, or split the work into several jobs."
            ),
            status=403,
            details={"limit": settings.PTC_MAX_JOB_TOOL_BYTES},
        )
    return int(found[0])


CALL_TIMEOUT_MESSAGE = "no result arrived in time: the tools workers may be down or overloaded"
# A call of a tool deleted since its job started, as its tools worker and a call over HTTP record it.
TOOL_GONE = "the tool no longer exists"


# A call over HTTP with a job's key naming no tool of the job's grant, as its bridge says: not counted.
_NOT_GRANTED = {"toolset_not_granted": 403, "unknown_tool": 400, "kind_unsupported": 400}
# How long a call over HTTP waits for its job's bridge to answer before it reads whether the job
# still runs (and asks again: a push may be lost); PTC_JOB_LEASE_SECONDS in all, by when the reaper
# has ended a job whose worker died.
ASK_SLICE_SECONDS = 1.0


def _job_call_ask(*, job: ExecJob, call_id: str, toolset: str, tool: str) -> tuple[str, int]:
    """Ask ``job``'s bridge to admit one more call over HTTP with its key (``Ask``), of ``toolset.tool``
    as the job was granted it when it started, counted with its code's calls. Return the id of that
    tool and the ``http_admit_epoch`` it is admitted under, or raise ApplicationError:
    ``toolset_not_granted`` (403), ``unknown_tool`` or ``kind_unsupported`` (400) for a tool not in
    the grant (not counted); ``tool_call_limit`` (403) past its max_tool_calls, ``parallel_limit``
    (429, retry) with its parallel cap in flight (1 when sequential), ``job_ended`` (409). Admitted,
    the call holds a slot of the cap until its ``Released`` (its tool's timeout, and more, at most).
    No statement unless the bridge is slow to answer."""
    ask = Ask(call_id=call_id, toolset=toolset, tool=tool)
    deadline = time.monotonic() + settings.PTC_JOB_LEASE_SECONDS
    with backplane().subscribe(call_channel(call_id)) as answers:
        while True:
            backplane().publish(job_channel(job.call_id), ask)
            until = min(deadline, time.monotonic() + ASK_SLICE_SECONDS)
            answer = None
            while answer is None and (left := until - time.monotonic()) > 0:
                # Not held while blocked, as a call's wait for its result holds none: calls waiting on
                # a worker that never answers (wedged, or older than the web) took the process's pool
                # for PTC_JOB_LEASE_SECONDS, and its every other request was 503 database_unavailable.
                connection.close()
                answers.wait(left)
                answer = next((m for m in answers.drain() if isinstance(m, Answer) and m.call_id == call_id), None)
            if answer is not None:
                break
            status = ExecJob.objects.filter(pk=job.pk).values_list("status", flat=True).first()
            if status != ExecJob.Status.RUNNING:
                raise ApplicationError(
                    "job_ended", f"Job {job.call_id} is not running (it is {status}); no call can start.", status=409
                )
            if time.monotonic() >= deadline:
                # It may yet be admitted: its slot is given back.
                backplane().publish(job_channel(job.call_id), Released(call_id=call_id, counted=False))
                logger.warning("a job's bridge did not answer a call over HTTP", extra={"job_id": str(job.pk)})
                raise ApplicationError(
                    "worker_unavailable",
                    f"Job {job.call_id}'s worker did not answer within {settings.PTC_JOB_LEASE_SECONDS} s whether this call "
                    "may start; nothing was run. Retry.",
                    status=503,
                )
    if answer.ok:
        return answer.tool_id, answer.epoch
    if answer.code in _NOT_GRANTED:
        message = answer.message or answer.code
        raise ApplicationError(answer.code, f"{message[:1].upper()}{message[1:]}.", status=_NOT_GRANTED[answer.code])
    if answer.code == "tool_call_limit":
        raise ApplicationError(
            "tool_call_limit",
            f"Job {job.call_id} has made its {answer.limit} tool calls, the most it may; no more can run.",
            status=403,
            details={"limit": answer.limit},
        )
    if answer.code == "parallel_limit":
        raise ApplicationError(
            "parallel_limit",
            f"Job {job.call_id} has {answer.limit} tool calls in flight, the most it may at once; retry when one has finished.",
            status=429,
            details={"limit": answer.limit, "retry_after": 1},
        )
    raise ApplicationError("job_ended", f"Job {job.call_id} is ending; no call can start.", status=409)


def _job_call_admit(*, job: ExecJob, epoch: int) -> None:
    """Raise ApplicationError ``job_ended`` (409) unless ``job`` is running, and _AdmissionLapsed
    unless its bridge still counts a call it admitted under ``epoch``. Locks the job's row until the
    caller's transaction ends: call it in the transaction that records the call (a job's end closes
    its open calls after it is recorded ended; its bridge raises the epoch under the same lock). Its
    limits are its bridge's to hold (``_job_call_ask``)."""
    found = ExecJob.objects.select_for_update().filter(pk=job.pk).values_list("status", "http_admit_epoch").first()
    status, now_epoch = found if found is not None else (None, 0)
    if status != ExecJob.Status.RUNNING:
        raise ApplicationError("job_ended", f"Job {job.call_id} is not running (it is {status}); no call can start.", status=409)
    if now_epoch > epoch:
        raise _AdmissionLapsed


def call_job_running() -> Exists:
    """The condition "the call's job is running", for an UPDATE of calls: an EXISTS, never a filter
    across the join. Django writes that one as ``WHERE id IN (SELECT ...)``, and PostgreSQL does not
    test such a subquery again once it has waited for a row another UPDATE held: of two answers to
    one waiting call at once, both would pass its status test, and both win."""
    return Exists(ExecJob.objects.filter(pk=OuterRef("exec_job_id"), status=ExecJob.Status.RUNNING))


def tool_needs_approval(*, tool: Tool, policy: Policy) -> bool:
    """Return True if each call of ``tool`` waits for an approval: the tool or its toolset says so,
    or the policy does for every tool that is not read_only."""
    return tool.requires_approval or tool.toolset.requires_approval or (policy.approval_for_writes and not tool.read_only)


def approved_call_timeout(call: ToolCall) -> float:
    """How long an approved call may run: its tool's timeout (select ``tool`` with the call)."""
    return tool_timeout_or_default(call.tool.timeout if call.tool else None)


def tool_run_timeout(tool: Tool) -> float:
    """How long a call of ``tool`` runs at most on a tools worker: its timeout as the row has it now
    (_tool_call_run), else PTC_DEFAULT_TOOL_TIMEOUT."""
    return tool_timeout_or_default(tool.timeout)


def tool_call_reply(call: ToolCall) -> dict[str, Any]:
    if call.status == ToolCall.Status.COMPLETED:
        return {"ok": True, "result": call.output}
    return {"ok": False, "error": call.error or call_error("tool_error", "the call failed")}


def tool_call_finish(
    *,
    call_id: str,
    output: Any = None,
    error: dict[str, str] | None = None,
    billed: bool = True,
    event: bool = True,
    record: ToolCall | None = None,
    from_statuses: tuple[str, ...] = ToolCall.OPEN,
    extra: dict[str, Any] | None = None,
    job_running: bool = False,
) -> bool:
    """Move an open call (executing, or awaiting its client or an approval; only ``from_statuses``)
    to completed or failed, settling or releasing its credits in the same transaction, and publish
    its event (unless ``event=False``: the caller does, later). Return False if it had already
    finished (a redelivery: nothing changes). ``billed=False`` says the tool is not billed (now),
    which skips the books unless a price was held for the call as it was made. ``record``, the
    call's row, is brought up to date. ``extra`` fields are written in the same UPDATE (who decided,
    when the client answered). With ``job_running``, only while the call's job runs (an answer to
    it: once its job has ended, its end closes its calls)."""
    fields = {**_finished_fields(output=output, error=error, now=timezone.now()), **(extra or {})}
    credits = 0
    billed = billed or bool(credits_held(tool_call_ids=[call_id]))
    settles = billed and not error
    if settles:
        # What it costs is what was held for it: recorded in the same UPDATE, settled right after.
        held = Reservation.objects.filter(tool_call_id=OuterRef("call_id"), status=Reservation.Status.HELD)
        fields["credits"] = Coalesce(Subquery(held.values("amount")[:1]), 0)
    # The call's row first (a redelivery finds it finished and charges nothing), the ledger last:
    # the account's row lock is held from its statement to the commit only. A hold is given back in
    # the transaction that fails its call, as tool_calls_fail_queued has it: given back after, a
    # release cancelled waiting on the account's row (held locked) left the call failed, and the
    # finish tried again found nothing left to fail: the hold stayed until the reaper's close.
    with transaction.atomic() if billed else nullcontext():
        open_calls = ToolCall.objects.filter(call_id=call_id, status__in=from_statuses)
        if job_running:
            open_calls = open_calls.filter(call_job_running())
        finished = bool(open_calls.update(**fields))
        if finished and settles:
            credits = credits_settle(tool_call_id=call_id)
        elif finished and billed:
            credits_release(tool_call_id=call_id)
    if finished and record is not None:
        _record_finished(record, fields, credits)
    if finished and event:
        _tool_call_event_publish(record if record is not None else ToolCall.objects.get(call_id=call_id))
    return finished


def _finished_fields(*, output: Any, error: dict[str, str] | None, now: datetime) -> dict[str, Any]:
    """What a call's row says once it ends with ``output`` or ``error``, made storable."""
    return {
        "status": ToolCall.Status.FAILED if error else ToolCall.Status.COMPLETED,
        "output": None if error else storable(output),
        "error": storable(error),
        "finished_at": now,
    }


def _record_finished(record: ToolCall, fields: dict[str, Any], credits: int) -> None:
    """Bring a finished call's row in memory up to date with what was written."""
    for name, value in {**fields, "credits": credits}.items():
        setattr(record, name, value)


def tool_calls_reserve(
    *, calls: list[tuple[str, Tool]], user: User, job: ExecJob | None, quotes: dict[Any, Any] | None = None
) -> dict[str, dict[str, str]]:
    """Hold the prices of calls ``(call_id, tool)`` before they run, a burst in one statement when
    the credits suffice. Return the errors of those refused, by call id: nothing else is done with
    them (a recorded call is failed by its caller, a call not yet recorded is recorded failed).

    ``quotes`` keeps a job's prices for its life, so its calls don't price the same tool again;
    those of a plan that has ended since (free tool access until a date) are priced anew.
    """
    holds = []
    now = timezone.now()
    for call_id, tool in calls:
        if quotes is not None and tool.pk in quotes and (quotes[tool.pk] is None or quotes[tool.pk].holds_at(now)):
            quote = quotes[tool.pk]
        else:
            quote = price_quote(user=user, toolset=tool.toolset, tool=tool)
            if quotes is not None:
                quotes[tool.pk] = quote
        if quote is not None:
            holds.append((call_id, quote))
    if not holds:
        return {}
    refused = credits_reserve(user=user, holds=holds, exec_job=job, max_credits=job.max_credits if job else None)
    return {call_id: exc.as_dict() for call_id, exc in refused.items()}


# Whether a price is held for the call a claim returns: a call is billed as it was made, so one
# whose toolset turned free while it was queued still settles what was held. Asked by the claim,
# where a question after the run was a round trip more on every free call's finish.
_PRICE_HELD = (
    f"EXISTS (SELECT 1 FROM {Reservation._meta.db_table} r "  # noqa: S608 - table names from the models
    f"WHERE r.tool_call_id = {ToolCall._meta.db_table}.call_id AND r.status = 'held')"
)
# The claim and the read of the rows in one statement (PostgreSQL and SQLite both have RETURNING):
# executing, unclaimed, and its job (if any) still running. {ids} is a placeholder per call, {brief}
# the condition that sets how long the statement waits on a lock (_lock_wait), {claim} the claim it
# takes: none yet, or one a try of its task made and never ran (ClaimUnrun).
_CALL_FIELDS = ToolCall._meta.concrete_fields
_CLAIM_SQL = f"""
UPDATE {ToolCall._meta.db_table} SET claimed_at = %s
WHERE call_id IN ({{ids}}) AND {{brief}} AND status = 'executing' AND {{claim}}
  AND (exec_job_id IS NULL OR EXISTS (
    SELECT 1 FROM {ExecJob._meta.db_table} j WHERE j.id = {ToolCall._meta.db_table}.exec_job_id AND j.status = 'running'))
RETURNING {rows.columns(ToolCall)}, {_PRICE_HELD}
"""  # noqa: S608 - table names from the models, values as parameters

# A queued call's record, written by the statement that claims it (its job still running, no row
# of it yet), and the failure of queued calls the bridge gave up on. Every column but the id.
_ROW_FIELDS = [field for field in _CALL_FIELDS if not field.primary_key]
_ROW_COLUMNS = ", ".join(str(field.column) for field in _ROW_FIELDS)


def _row_values(cast: bool = False) -> str:
    """A row of these statements' values, a placeholder each, ``cast`` to its column's type (a VALUES
    list in a FROM has its own types, not the table's). The tool is written only if it still exists:
    one deleted while its calls waited in the queue would fail its foreign key at commit, and with it
    every call the statement writes. On PostgreSQL its row is locked (KEY SHARE) until the commit: a
    delete under way is waited for (and the tool is then not written), a later one waits for this."""
    values = [f"%s::{field.cast_db_type(connection)}" if cast else "%s" for field in _ROW_FIELDS]
    lock = " FOR KEY SHARE" if connection.vendor == "postgresql" else ""
    return ", ".join(
        f"(SELECT tt.id FROM {Tool._meta.db_table} tt WHERE tt.id = {value}{lock})" if field.name == "tool" else value  # noqa: S608
        for field, value in zip(_ROW_FIELDS, values, strict=True)
    )


_JOB_RUNNING = f"SELECT 1 FROM {ExecJob._meta.db_table} j WHERE j.id = {{job}} AND j.status = 'running'"  # noqa: S608
_RECORD_CLAIMED_SQL = f"""
INSERT INTO {ToolCall._meta.db_table} ({_ROW_COLUMNS})
SELECT * FROM (VALUES {{rows}}) AS v ({_ROW_COLUMNS})
WHERE (v.exec_job_id IS NULL OR EXISTS ({_JOB_RUNNING.format(job="v.exec_job_id")})) AND {brief_lock_wait_sql("%s")}
ON CONFLICT (call_id) DO NOTHING
RETURNING call_id, id, tool_id, {_PRICE_HELD}
"""  # noqa: S608
_RECORD_CLAIMED_ONE_SQL = f"""
INSERT INTO {ToolCall._meta.db_table} ({_ROW_COLUMNS})
SELECT {_row_values()} WHERE %s IS NULL OR EXISTS ({_JOB_RUNNING.format(job="%s")})
ON CONFLICT (call_id) DO NOTHING
RETURNING call_id, id, tool_id, {_PRICE_HELD}
"""
_FAIL_QUEUED_SQL = f"""
INSERT INTO {ToolCall._meta.db_table} ({_ROW_COLUMNS}) VALUES {{rows}}
ON CONFLICT (call_id) DO UPDATE SET status = excluded.status, error = excluded.error, finished_at = excluded.finished_at
WHERE {ToolCall._meta.db_table}.status IN ({", ".join(f"'{status.value}'" for status in ToolCall.OPEN)}) {{unclaimed}}
RETURNING call_id
"""  # noqa: S608


@functools.cache
def _claimed_row() -> str:
    """One row of _RECORD_CLAIMED_SQL's VALUES on PostgreSQL."""
    return f"({_row_values(cast=True)})"


# A batch of calls that ran, finished in one statement on PostgreSQL: each open call moves to its
# status and output; one that completes a billed call records what was held for it (settled in the
# same statement, or right after in the same transaction). Returns the calls it moved.
_FINISHED = f"""
finished AS (
  UPDATE {ToolCall._meta.db_table} AS t SET
    status = v.status, output = v.output, error = v.error, finished_at = %(now)s,
    credits = CASE WHEN v.settles THEN COALESCE((
      SELECT r.amount FROM {Reservation._meta.db_table} r WHERE r.tool_call_id = t.call_id AND r.status = 'held' LIMIT 1
    ), 0) ELSE t.credits END
  FROM jsonb_to_recordset(%(calls)s::jsonb)
    AS v(call_id text, status text, output jsonb, error jsonb, settles boolean, releases boolean)
  WHERE t.call_id = v.call_id AND t.status IN ({", ".join(f"'{status.value}'" for status in ToolCall.OPEN)})
    AND {brief_lock_wait_sql()}
  RETURNING t.call_id, t.credits, v.settles, v.releases
)"""  # noqa: S608
_FINISH_SQL = f"WITH {_FINISHED} SELECT call_id, credits FROM finished"  # noqa: S608
# The same, and the settle of the billed calls it moves, all of one user's: one round trip where
# BEGIN, the UPDATE, the settle and COMMIT were four, on every billed call's path.
_FINISH_SETTLE_SQL = (
    f"WITH {_FINISHED}, {PostgresLedger.settling('SELECT call_id FROM finished WHERE settles')} "  # noqa: S608
    "SELECT call_id, credits FROM finished"
)
# And the release of the billed calls that failed (the same user's): their holds closed with their
# records, in one statement.
_FINISH_CLOSE_SQL = (
    f"WITH {_FINISHED}, "  # noqa: S608
    f"{PostgresLedger.settling('SELECT call_id FROM finished WHERE settles', 'SELECT call_id FROM finished WHERE releases')} "
    "SELECT call_id, credits FROM finished"
)


# The calls this process is running, whose leases tool_calls_heartbeat renews.
_running_calls: set[str] = set()
_running_lock = threading.Lock()


def tool_calls_heartbeat() -> int:
    """Renew the lease of every call this tools worker is running, but those whose rows are held
    locked now (skipped: their own finish under way, or a transaction stuck elsewhere, whose call the
    reaper leaves to a later round as well: LockedRows). Return how many were renewed.

    One row held locked held up the renewal of all: the statement waited on it, up to
    PTC_DB_STATEMENT_TIMEOUT at each renewal, the other calls' leases lapsed, and the reaper failed
    them worker_lost as this worker ran them."""
    with _running_lock:
        running = list(_running_calls)
    if not running:
        return 0
    return _tool_calls_renew(running)


def _tool_calls_renew(call_ids: list[str]) -> int:
    """Renew the leases of the calls ``call_ids`` still executing, but those whose rows are held
    locked now. Return how many were renewed."""
    with transaction.atomic():  # SKIP LOCKED takes its locks in a transaction
        free = ToolCall.objects.select_for_update(skip_locked=True).filter(call_id__in=call_ids, status=ToolCall.Status.EXECUTING)
        return ToolCall.objects.filter(pk__in=free.values("pk")).update(heartbeat_at=timezone.now())


def tool_call_execute(
    *, call_id: str, record: str | None = None, alone: bool = False, outcome: str | None = None, claim: str | None = None
) -> None:
    """Run one call, once: claim it, run it, record the result, push it to the job. Raise
    OutcomeUnrecorded if what it came to could not be recorded; its task's retry brings that
    ``outcome`` back, and it is recorded (nothing is claimed or run again). Raise ClaimUnrun if the
    database failed after the claim, before the tool ran, or failed the claim with no answer (it may
    have committed, its reply lost); its task's retry brings that ``claim`` back, and takes it over
    (or claims the call, if it was never made) to run the call.

    A call from a job's sandbox comes with its ``record`` (signed): the claim writes it, one
    conditional INSERT, if its job still runs and no row of it exists yet. Any other call was
    recorded before it was queued: the claim is one conditional UPDATE, if it is still executing,
    unclaimed, and its job still running. A task delivered again finds the claim taken: if the call
    finished, its result is pushed again (the bridge ignores repeats); if it runs under a fresh
    lease, the delivery is a duplicate and is dropped; if its lease lapsed, the worker that ran it
    died, and it fails as ``worker_lost`` rather than run twice.

    The claim goes with those of this worker's other threads, a batch at a time (``_claims``); with
    ``alone`` (its task's retry), on its own: a claim that failed may fail again (its statement
    cancelled, waiting on a row held locked), and through the batches each try held up every other
    call's claim on this worker as long.
    """
    queued = _tool_call_unsigned(record) if record is not None else None
    if outcome is not None:
        _tool_call_outcome_record(call_id=call_id, outcome=outcome, queued=queued)
        return
    if record is not None and queued is None:
        # Not made by this deployment's bridge (or the workers' SECRET_KEYs differ): nothing is run
        # or recorded; the code it names, if any, gets an error rather than wait for its timeout.
        logger.error("a tool call's message failed its signature check; not run", extra={"call_id": call_id})
        reply: dict[str, Any] = {"ok": False, "error": call_error("internal_error", BAD_RECORD_MESSAGE)}
        backplane().publish(_result_channel(call_id, _unverified_job(record)), Result(call_id=call_id, **reply))
        return
    taken = _claim_taken(call_id=call_id, claim=claim) if claim is not None else ()
    try:
        call = _tool_call_claim(call_id, queued, alone=alone, taken=taken)
    except _ClaimUnanswered as unanswered:
        # Its claim may be in the database, this try's own: raised bare, its task's retry found the
        # call claimed under a fresh lease and dropped it as a duplicate, and a lease later the
        # reaper failed it worker_lost, though nothing had run it.
        logger.warning("a call's claim got no answer from the database; its task's retry runs it", extra={"call_id": call_id})
        raise ClaimUnrun(call_id=call_id, claimed=(*taken, unanswered.claimed_at)) from unanswered.__cause__
    claimed = call is not None
    if call is None:
        call = ToolCall.objects.filter(call_id=call_id).first()
    if call is None and queued is not None:
        # Its job no longer runs: it is recorded as never run (or as whatever recorded it meanwhile),
        # without its input if retention has emptied the job since (its worker died with it queued).
        purged = ExecJob.objects.filter(purged_at__isnull=False)
        if queued.exec_job_id is not None and purged.filter(pk=queued.exec_job_id).exists():
            queued.input = {}
        tool_calls_fail_queued([queued], error=call_error("job_ended", JOB_ENDED_MESSAGE), running=False)
        call = ToolCall.objects.filter(call_id=call_id).first()
    if call is None:
        logger.warning("tool call not found", extra={"call_id": call_id})
        return
    if claimed:
        try:
            tool = tool_for_call(tool_id=call.tool_id) if call.tool_id else None
        except (OperationalError, InterfaceError) as exc:
            # Claimed, not run: its task's retry takes the claim over. Raised bare, the retry found
            # the call claimed under a fresh lease and dropped it as a duplicate, and a lease later
            # the reaper failed it worker_lost, though no worker had died.
            logger.warning("a claimed call's tool could not be looked up; its task's retry runs it", extra={"call_id": call_id})
            assert call.claimed_at is not None, "its claim set it"
            raise ClaimUnrun(call_id=call_id, claimed=(call.claimed_at,)) from exc
        if tool is not None and not (tool.enabled and tool.toolset.enabled):
            # Disabled since the call was made (a running job's tools are those it started with): an
            # admin stopping a tool that misbehaves stops its calls no worker has started yet too.
            disabled = f"'{tool}' was disabled before this call started; it was not run"
            reply = _tool_call_fail_retried(call_id, "tool_disabled", disabled)
        elif tool is not None:
            with _running_lock:
                _running_calls.add(call_id)
            try:
                _tool_call_run(call=call, tool=tool)  # which pushes its result and its event
            finally:
                with _running_lock:
                    _running_calls.discard(call_id)
            return
        else:
            reply = _tool_call_fail_retried(call_id, "unknown_tool", TOOL_GONE)
    elif call.status != ToolCall.Status.EXECUTING:
        # Ended: this delivery's try before may have ended it, its worker gone before the end was appended.
        _tool_call_record_push(call)
        return
    elif call.claimed_at in taken:
        # Still the claim its task's try made and never ran, not taken over: its job no longer runs.
        reply = _tool_call_fail_retried(call_id, "job_ended", JOB_ENDED_MESSAGE)
    elif call.claimed_at is not None and _lease_fresh(call):
        # Its worker renews the lease: it is alive and running the call. This delivery is a
        # duplicate (a replayed publish, an early restore): dropped, the running call untouched.
        logger.warning("a duplicate delivery of a running call was dropped", extra={"call_id": call_id})
        return
    elif call.claimed_at is not None:
        reply = _tool_call_fail_retried(call_id, "worker_lost", WORKER_LOST_MESSAGE)
    else:
        reply = _tool_call_fail_retried(call_id, "job_ended", JOB_ENDED_MESSAGE)
    backplane().publish(_result_channel(call_id, call.ptc_call_id), Result(call_id=call_id, **reply))


JOB_ENDED_MESSAGE = "the job ended before this call started; it was not run"  # also the job's close's
WORKER_LOST_MESSAGE = "the tools worker running this call stopped; it was not run again"
BAD_RECORD_MESSAGE = (
    "the call's message failed its signature check and was not run: every worker of a deployment needs the same DJANGO_SECRET_KEY"
)


def _lease_fresh(call: ToolCall) -> bool:
    """Whether the worker that claimed ``call`` renewed its lease (or claimed it) within the lease."""
    lease = call.heartbeat_at or call.claimed_at
    return lease is not None and lease > timezone.now() - timedelta(seconds=settings.PTC_JOB_LEASE_SECONDS)


def _tool_call_claim(call_id: str, queued: ToolCall | None, *, alone: bool, taken: tuple[datetime, ...]) -> ToolCall | None:
    """Claim one call (``queued``: with its record, if it comes with one). Return its row if this
    claimed it, else None. With the claims of this worker's other threads, when they coincide; a
    retry's (``alone``; ``taken``: the claims a try of its task left it, ClaimUnrun's) on its own.
    A batch waits on a lock briefly: one that waited longer (its statement cancelled, nothing
    claimed) is tried again at once alone, by each of its calls, on its own thread. Alone, it waits
    on a lock as briefly, and the one whose row (or user's, or job's) is held locked is tried again
    (db_retry), its connection given back between tries, its tries taking turns (_LockWaits), as a
    finish's: waiting out the lock on it, a user's calls whose row was held locked (their records'
    foreign key, checked at the commit) took one pooled connection each for up to
    PTC_DB_STATEMENT_TIMEOUT, past PTC_DB_POOL_MAX of them the whole pool, and every other call on
    this worker found none. A cancelled claim claimed nothing: tried again, it claims once."""
    if not (alone or taken):
        try:
            return _claims((call_id, queued))
        except OperationalError as exc:
            if not statement_cancelled(exc):
                raise
    waits = _LockWaits()
    claim = functools.partial(_tool_calls_claim, [(call_id, queued)], brief=True, taken=taken)
    return db_retry(lambda: waits(claim), what="claiming a tool call", job_id="", call_id=call_id)[0]


class _ClaimUnanswered(Exception):
    """A claim the database failed other than by cancelling it (the connection dropped): it may have
    committed all the same, its reply lost, its calls claimed at ``claimed_at``."""

    def __init__(self, claimed_at: datetime) -> None:
        super().__init__("a claim got no answer from the database")
        self.claimed_at = claimed_at


def _tool_calls_claim(
    items: list[tuple[str, ToolCall | None]], *, brief: bool = False, taken: tuple[datetime, ...] = ()
) -> list[ToolCall | None]:
    """Claim calls ``(call_id, record or None)``: the queued ones by writing their records, the
    recorded ones by updating theirs, a statement each (in one transaction when there are both: a
    batch that fails has claimed none of them). Return each one's row if this claimed it, else None
    (a repeat of a call in the same batch is not claimed twice). With ``brief`` (a batch of this
    worker's), a lock is waited on BRIEF_LOCK_WAIT_MS at most: a row held locked longer fails the
    batch (its statement cancelled) rather than hold its other calls up to PTC_DB_STATEMENT_TIMEOUT.
    With ``taken`` (a retry's one call), one found claimed at one of those times, by a try of its
    task that never ran it, is taken over. Raise _ClaimUnanswered if the database failed other than
    by cancelling a statement (which undoes it): the claim may have committed."""
    now = timezone.now()
    claimed: dict[str, ToolCall] = {}
    queued = {call_id: record for call_id, record in items if record is not None}
    recorded = list(dict.fromkeys(call_id for call_id, record in items if record is None))
    try:
        # Apart, the records written by the first statement stayed claimed when the second failed: their
        # tasks, tried again, found them claimed under a fresh lease and dropped them as duplicates.
        with transaction.atomic() if queued and recorded else nullcontext():
            if queued:
                claimed.update(_tool_calls_record_claimed(list(queued.values()), now=now, brief=brief))
            if recorded:
                claimed.update(_tool_calls_update_claimed(recorded, now=now, brief=brief))
        if taken and not claimed:
            # Taken over by the one statement that checks the claim is still a try's and moves it: of
            # two deliveries of the retry one only takes it. After the claim, which waited for a claim
            # of the call still committing (the INSERT's conflict, the UPDATE's row lock): a try's
            # whose reply was lost is seen here.
            claimed.update(_tool_calls_update_claimed([call_id for call_id, _ in items], now=now, taken=taken))
    except (OperationalError, InterfaceError) as exc:
        if statement_cancelled(exc):
            raise
        raise _ClaimUnanswered(now) from exc
    return [claimed.pop(call_id, None) for call_id, _ in items]


def _tool_calls_update_claimed(
    call_ids: list[str], *, now: datetime, brief: bool = False, taken: tuple[datetime, ...] = ()
) -> dict[str, ToolCall]:
    """Claim recorded calls, one UPDATE: those still executing, unclaimed (with ``taken``: claimed at
    one of those times, by a try of their task that never ran them), whose job still runs. Return
    their rows, by call id. ``brief``: as ``_tool_calls_claim``'s."""
    postgres = connection.vendor == "postgresql"
    wait = brief_lock_wait_sql("%s") if postgres else "1 = 1"
    claim = f"claimed_at IN ({', '.join(['%s'] * len(taken))})" if taken else "claimed_at IS NULL"
    sql = _CLAIM_SQL.format(ids=", ".join(["%s"] * len(call_ids)), brief=wait, claim=claim)
    params = [now, *call_ids, *([brief_lock_wait(brief)] if postgres else []), *taken]
    claimed = {}
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        for row in cursor.fetchall():
            call = rows.from_row(ToolCall, row)
            call.price_held = bool(row[-1])  # type: ignore[attr-defined]  # as _CLAIM_SQL returns it
            claimed[call.call_id] = call
    return claimed


def _tool_calls_record_claimed(calls: list[ToolCall], *, now: datetime, brief: bool = False) -> dict[str, ToolCall]:
    """Write queued calls' records, claimed (``claimed_at``), those whose job still runs and of which
    no row exists yet. Return the ones written, by call id, saved. ``brief``: as ``_tool_calls_claim``'s."""
    for call in calls:
        call.claimed_at = now
    if connection.vendor == "postgresql":
        placeholders = ", ".join([_claimed_row()] * len(calls))
        params = [value for call in calls for value in rows.prepared(call, _ROW_FIELDS)]
        params.append(brief_lock_wait(brief))
        with connection.cursor() as cursor:
            cursor.execute(_RECORD_CLAIMED_SQL.format(rows=placeholders), params)
            written = {call_id: (pk, tool_id, held) for call_id, pk, tool_id, held in cursor.fetchall()}
    else:  # SQLite: a statement a call, each its own check of the job
        written = {}
        with connection.cursor() as cursor:
            for call in calls:
                job = call.exec_job_id and ExecJob._meta.pk.get_db_prep_save(call.exec_job_id, connection)
                cursor.execute(_RECORD_CLAIMED_ONE_SQL, [*rows.prepared(call, _ROW_FIELDS), job, job])
                written.update((call_id, (pk, tool_id, held)) for call_id, pk, tool_id, held in cursor.fetchall())
    for call in calls:
        if call.call_id in written:
            call.pk, call.tool_id, held = written[call.call_id]  # no tool: deleted since the call was checked
            call.price_held = bool(held)  # type: ignore[attr-defined]  # as _RECORD_CLAIMED_SQL returns it
            call._state.adding = False
            call._state.db = connection.alias
        else:
            call.claimed_at = None  # not this claim's
    return {call.call_id: call for call in calls if call.call_id in written}


# A batch waits on a lock briefly: a call whose claim waits longer is claimed again alone (tool_call_execute).
_claims = GroupCommit(functools.partial(_tool_calls_claim, brief=True))


def _result_channel(call_id: str, ptc_call_id: str) -> str:
    """A job's calls report on the job's channel; a standalone call on its own."""
    return job_channel(ptc_call_id) if ptc_call_id else call_channel(call_id)


def tool_call_abort(*, call_id: str, record: str | None = None) -> None:
    """Fail a call whose task crashed (recording it failed if its record was never written), and
    push that to its job, so the code gets a ToolError now."""
    error = call_error("internal_error", "the tools worker failed while running this call; see its log")
    queued = _tool_call_unsigned(record) if record is not None else None

    def fail() -> None:
        if queued is not None:
            tool_calls_fail_queued([queued], error=error, running=True)
        else:
            tool_call_finish(call_id=call_id, error=error)

    # Tried again through a database away or a statement cancelled, as a call's finish is, then
    # carried by its task's retry (OutcomeUnrecorded): raised bare, the call stayed executing under its
    # claim, its task's retry dropped it as a duplicate, and the reaper failed it worker_lost a lease
    # later, which says its worker died, not what happened.
    job_id = queued.exec_job_id if queued else ""
    crashed = {"ok": False, "error": error}
    _tool_call_failure_retried(fail, call_id=call_id, job_id=job_id, what="recording a call's failure", reply=crashed)
    _tool_call_recorded_push(call_id)


def _tool_call_recorded_push(call_id: str) -> None:
    """Push the call's record's word to its waiting code, if it has a record (``_tool_call_record_push``)."""
    call = ToolCall.objects.filter(call_id=call_id).first()
    if call is not None:
        _tool_call_record_push(call)


def _tool_call_record_push(call: ToolCall) -> None:
    """Push the record's word (its result, or its error) to the call's waiting code; and, once the
    call has ended, its end to its job's events unless they have it. For a call found closed by a
    try that may have closed it: a finish whose reply was lost after its commit (the connection
    dropped) is tried again and finds the call closed, its end never appended (whoever else closed
    it appended it), and its job's stream, timeline and events missed the call's end. One round
    trip, as the push alone was."""
    pushes: list[tuple[str, Message]] = [
        (_result_channel(call.call_id, call.ptc_call_id), Result(call_id=call.call_id, **tool_call_reply(call)))
    ]
    if call.status in ToolCall.OPEN:
        backplane().publish(*pushes[0])
    else:
        backplane().call_end_push(pushes, job_call_id=call.ptc_call_id, call_id=call.call_id, end=tool_call_event(call))


# What a call came to (its reply, and whether it is billed), as its task's retry carries it: signed
# with the deployment's SECRET_KEY, as a queued call's record is, so that what reaches the broker
# can't end a call, or charge for it, with a result of its own; with its call's id, or one carried
# for a call could be put on another's task, which then ended with that call's result (another
# user's, perhaps).
_OUTCOME_SIGNER = signing.Signer(salt="ptc.execute_tool.outcome")


class RetryCarries(Exception):
    """A try of a call's task that leaves its retry what it must know: ``kwargs``, the retry's
    keyword arguments (signed, as ``tool_call_execute`` takes them)."""

    def __init__(self, message: str, **kwargs: str) -> None:
        super().__init__(message)
        self.kwargs = kwargs


class OutcomeUnrecorded(RetryCarries):
    """What a call this worker claimed (or found claimed) came to (its tool's result, or the error it
    failed with) that the database did not take within PTC_DB_RETRY_SECONDS (away, or cancelling the
    statement: a row it needs held locked). ``outcome``, signed, goes with its task's retry, which
    records it (``tool_call_execute``) and never runs the tool again. Raised bare, the retry found the call
    claimed under the lease the recording's tries had renewed, dropped it as a duplicate, and a
    lease later the reaper failed it worker_lost, which said its worker died, not what happened."""

    def __init__(self, *, call_id: str, reply: dict[str, Any], billed: bool) -> None:
        self.outcome = _OUTCOME_SIGNER.sign(json.dumps({"call_id": call_id, "reply": reply, "billed": billed}))
        super().__init__(f"call {call_id}'s outcome could not be recorded", outcome=self.outcome)


# A claim a try of a call's task made and never ran, as its retry carries it: signed, as an outcome
# is, so that what reaches the broker can't take over another claim.
_CLAIM_SIGNER = signing.Signer(salt="ptc.execute_tool.claim")


class ClaimUnrun(RetryCarries):
    """A call this worker claimed that a database error (away, or the statement cancelled: a lock
    it waits on held) stopped before its tool ran, or whose claim got no answer (the connection
    dropped: it may have committed, its reply lost). ``claim``, signed (the call and the times the
    tries of its task claimed it at, or may have: ``claimed``), goes with its task's retry, which
    takes that claim over (or claims the call, if none was made) and runs the call
    (``tool_call_execute``). Those times are the tries' own: a delivery of the call's task to
    another worker, which claimed it, never has its claim taken over."""

    def __init__(self, *, call_id: str, claimed: tuple[datetime, ...]) -> None:
        self.claim = _CLAIM_SIGNER.sign(json.dumps([call_id, *(at.isoformat() for at in claimed)]))
        super().__init__(f"call {call_id} was claimed and not run", claim=self.claim)


def _claim_taken(*, call_id: str, claim: str) -> tuple[datetime, ...]:
    """When the claim ``claim`` (ClaimUnrun's) of call ``call_id`` was (or may have been) made; none
    if it is not one this deployment's workers made of that call."""
    try:
        claimed_id, *claimed_at = json.loads(_CLAIM_SIGNER.unsign(claim))
    except signing.BadSignature:
        claimed_id, claimed_at = None, []
    if claimed_id != call_id:
        # Not made by this deployment's workers (or another call's): the call's lease decides.
        logger.error("a tool call's carried claim failed its signature check; not taken over", extra={"call_id": call_id})
        return ()
    return tuple(datetime.fromisoformat(at) for at in claimed_at)


def _tool_call_end_retried(
    end: Callable[[], T], *, call_id: str, job_id: Any, what: str, reply: dict[str, Any], billed: bool
) -> T:
    """Run ``end``, which records that the call came to ``reply`` (``billed``: a price was held for
    it), through a database away or a statement cancelled (``db_retry``), and return what it
    returns; past PTC_DB_RETRY_SECONDS, raise OutcomeUnrecorded for the task's retry to record it."""
    try:
        return db_retry(end, what=what, job_id=job_id, call_id=call_id)
    except (OperationalError, InterfaceError) as exc:
        logger.warning("%s failed past PTC_DB_RETRY_SECONDS; its task's retry records it", what, extra={"call_id": call_id})
        raise OutcomeUnrecorded(call_id=call_id, reply=reply, billed=billed) from exc


def _tool_call_outcome_record(*, call_id: str, outcome: str, queued: ToolCall | None) -> None:
    """Record what the call came to, as a try of its task before this one carried it
    (OutcomeUnrecorded), then push it to the code and its event; or, ended meanwhile (the bridge gave
    up on it, or the reaper), push the record's word. A failure of a ``queued`` call with no record
    (its task crashed before its claim wrote it) is recorded failed, as ``tool_call_abort`` does.
    Raise OutcomeUnrecorded again if the database still does not take it."""
    carried = _outcome_unsigned(call_id=call_id, outcome=outcome)
    if carried is None:
        return
    reply, billed = carried["reply"], carried["billed"]

    def end() -> bool:
        """Whether the outcome was recorded and pushed here."""
        # Its lease first: no renewal of any worker's kept it while this retry waited its turn.
        _tool_calls_renew([call_id])
        call = ToolCall.objects.filter(call_id=call_id).first()
        if call is None and queued is not None and not reply["ok"]:
            tool_calls_fail_queued([queued], error=reply["error"], running=True)
            return False  # its result is its record's word, pushed below
        return call is not None and _tool_calls_finish_ran([_Ran(call=call, reply=reply, billed=billed)], brief=True)[0]

    # As the finish of its first task: a lock waited on briefly, and tried again, its connection given back.
    waits = _LockWaits()
    what = "recording a tool call's outcome that an earlier try could not"
    if not _tool_call_end_retried(lambda: waits(end), call_id=call_id, job_id="", what=what, reply=reply, billed=billed):
        _tool_call_recorded_push(call_id)


def _outcome_unsigned(*, call_id: str, outcome: str) -> dict[str, Any] | None:
    """What call ``call_id`` came to, as ``outcome`` (OutcomeUnrecorded's) carries it; None, logged,
    if it is not one this deployment's workers made of that call."""
    try:
        carried = json.loads(_OUTCOME_SIGNER.unsign(outcome))
    except signing.BadSignature:
        carried = {}
    if carried.get("call_id") != call_id:
        # Not made by this deployment's workers, or for another call: nothing is recorded; the call's lease decides.
        logger.error("a tool call's carried outcome failed its signature check; not recorded", extra={"call_id": call_id})
        return None
    return dict(carried)


def tool_call_outcome_keep(*, call_id: str, outcome: str) -> bool:
    """Keep what a call came to (``outcome``, OutcomeUnrecorded's), which the database did not take
    through the last of its task's retries either (away, or cancelling the statement, longer than
    they last), where the reaper finds it (``tool_calls_reap``): it records it, and charges it, once
    the database takes it, rather than fail the call ``worker_lost`` as if its tool had not run.
    Say so once, ERROR: the call's result waits on the database. Return whether it is kept; if not
    (Redis away as well), the ERROR says the outcome is lost."""
    if backplane().outcome_keep(call_id, outcome):
        logger.error(
            "a tool call's outcome (its tool's result: the tool ran; or the failure its worker decided) could not be "
            "recorded through all its task's retries: kept for the reaper to record once the database takes it",
            extra={"call_id": call_id},
        )
        return True
    logger.error(
        "a tool call's outcome (its tool's result: the tool ran; or the failure its worker decided) could not be "
        "recorded through all its task's retries, nor kept: it is lost, and the reaper fails the call worker_lost "
        "(a billed call is not charged)",
        extra={"call_id": call_id},
    )
    return False


def _tool_call_kept_record(call_id: str, outcome: str) -> bool:
    """Record what the lapsed call ``call_id`` came to as its task's last retry kept it
    (``tool_call_outcome_keep``), settling or releasing its hold, and push it to its code and its
    event; then forget it. Return False if ``outcome`` is not one this deployment's workers made of
    that call (the reaper fails the call as it would have)."""
    carried = _outcome_unsigned(call_id=call_id, outcome=outcome)
    call = ToolCall.objects.filter(call_id=call_id).first()
    if carried is None or call is None:
        backplane().outcomes_drop([call_id])
        return False
    if _tool_calls_finish_ran([_Ran(call=call, reply=carried["reply"], billed=carried["billed"])])[0]:
        logger.warning("recorded a tool call's outcome kept by its task's last retry", extra={"call_id": call_id})
    backplane().outcomes_drop([call_id])
    return True


def _tool_call_fail_retried(call_id: str, code: str, message: str) -> dict[str, Any]:
    """``_tool_call_fail`` for a call this worker claimed (or found claimed), tried again through a
    database away or a statement cancelled (a row it needs held locked), for up to PTC_DB_RETRY_SECONDS,
    as a call's finish is; past that, raise OutcomeUnrecorded, for its task's retry to record."""
    failed = {"ok": False, "error": call_error(code, message)}
    what = f"recording a call's failure ({code})"
    return _tool_call_failure_retried(
        lambda: _tool_call_fail(call_id, code, message), call_id=call_id, job_id="", what=what, reply=failed
    )


def _tool_call_failure_retried(fail: Callable[[], T], *, call_id: str, job_id: Any, what: str, reply: dict[str, Any]) -> T:
    """Run ``fail``, which records that a call this worker claimed (or found claimed) failed with
    ``reply``, and return what it returns: as a finish is, waiting on a lock BRIEF_LOCK_WAIT_MS at
    most and tried again (db_retry), its connection given back between tries, which take turns once
    one was cancelled so (_LockWaits); past PTC_DB_RETRY_SECONDS, raise OutcomeUnrecorded. Waiting out
    a row held locked (its account's, as what was held for it goes back), each such failure held a
    pooled connection for up to PTC_DB_STATEMENT_TIMEOUT, and past PTC_DB_POOL_MAX of them other
    users' calls on this worker found none. Each try after the first renews the call's lease first:
    no renewal of this worker's keeps it, and the reaper failed it worker_lost between tries."""
    waits = _LockWaits()
    tries = 0

    def tried() -> T:
        nonlocal tries
        if tries:
            _tool_calls_renew([call_id])
        tries += 1
        with lock_wait_brief():
            return fail()

    # Billed: what was held for it, if anything, goes back (as tool_call_finish has it for a failure).
    return _tool_call_end_retried(lambda: waits(tried), call_id=call_id, job_id=job_id, what=what, reply=reply, billed=True)


def _tool_call_fail(call_id: str, code: str, message: str) -> dict[str, Any]:
    """Fail the call ``code``, or find it ended; return the reply for its code. Found ended, its end
    goes to its job's events unless they have it (``_tool_call_record_push``: a try of this
    failure whose reply was lost after its commit appended none)."""
    error = call_error(code, message)
    if tool_call_finish(call_id=call_id, error=error):
        return {"ok": False, "error": error}
    call = ToolCall.objects.get(call_id=call_id)
    if call.status not in ToolCall.OPEN:
        backplane().call_end_push([], job_call_id=call.ptc_call_id, call_id=call_id, end=tool_call_event(call))
    return tool_call_reply(call)


def _tool_call_run(*, call: ToolCall, tool: Tool) -> None:
    """Run the tool, record the outcome on ``call``, push it to the waiting code, then its event."""
    call_id, arguments = call.call_id, call.input
    started = time.monotonic()
    # Hand the database connection back to the pool while the tool runs: a slow tool must not hold
    # one of the pool's few connections idle while other calls wait for it. One that fails to go
    # back is dropped, and the tool runs: it needs none. Raised, the call stayed claimed and unrun,
    # its task's retry dropped it as a duplicate, and a lease later the reaper failed it worker_lost.
    db_reset()
    try:
        output = tool_run(toolset=tool.toolset, tool=tool, arguments=arguments, timeout=tool_run_timeout(tool))
        # Only the output's own failure to be JSON is invalid_output: another error of the tool's run
        # is a bug, which ends the call internal_error with the traceback logged (tool_call_abort).
        try:
            size = len(json.dumps(output, allow_nan=False))
        except (TypeError, ValueError) as exc:
            raise ToolFailure("invalid_output", f"the tool's output is not JSON: {exc}") from None
        limit = settings.PTC_MAX_TOOL_OUTPUT_BYTES
        if size > limit:
            raise ToolFailure("output_too_large", f"the tool returned {size} bytes of JSON; the limit is {limit}")
    except ToolFailure as failure:
        reply: dict[str, Any] = {"ok": False, "error": failure.as_dict()}
    else:
        reply = {"ok": True, "result": output}
    # Billed as it was made: what was held for it as it was made (the claim says whether a price
    # was) is settled or released, whatever its toolset's billing says by now. The tool has run: its
    # result is worth waiting for, through a database away or a statement cancelled (its account's
    # row held locked past PTC_DB_STATEMENT_TIMEOUT), as a job's end is, and past PTC_DB_RETRY_SECONDS
    # it goes with the task's retry (OutcomeUnrecorded). The finish changes only open calls: a retry
    # never finishes one twice, nor charges it twice.
    ran = _Ran(call=call, reply=reply, billed=call.price_held)  # type: ignore[attr-defined]  # set by the claim
    first = True

    def finish() -> bool:
        # Through this worker's batches the first time, alone after: its batches run one at a time,
        # and a finish waiting on a row held locked (its account's) held up every other call's
        # finish on this worker for as long, at each of its retries (and failed those batched with it).
        # A batch waits on a lock briefly: one that waited longer is tried again alone at once (each
        # of its calls: which one waited is not known). Alone, it waits on a lock as briefly, and
        # the one the lock holds is tried again (db_retry), its connection given back to the pool
        # between tries: waiting out the lock on it, a user's calls whose account's row was held
        # locked took one pooled connection each for up to PTC_DB_STATEMENT_TIMEOUT, past
        # PTC_DB_POOL_MAX of them the whole pool, and every other call on this worker (other users')
        # found none and was retried as if the database were away.
        # Tried again after a failure, it renews the call's lease first: the renewals of this worker
        # skip a row held locked, as the call's is by its own finish waiting on its account's row,
        # and the reaper failed the call worker_lost between two tries.
        nonlocal first
        renew = not first
        if first:
            first = False
            try:
                return _finishes(ran)
            except OperationalError as exc:
                if not statement_cancelled(exc):
                    raise
        return waits(functools.partial(_tool_call_finish_alone, ran, renew=renew))

    waits = _LockWaits()

    what = "recording a tool call's result"
    finished = _tool_call_end_retried(finish, call_id=call_id, job_id=call.exec_job_id, what=what, reply=reply, billed=ran.billed)
    # A tools worker's one line a call (Celery's own per-task lines are off there): STYLE.md §14's ids.
    job = {"job_id": str(call.exec_job_id)} if call.exec_job_id else {}
    ms = round((time.monotonic() - started) * 1000, 2)
    logger.info("tool call ran", extra={**job, "call_id": call_id, "tool": str(tool), "ok": reply["ok"], "ms": ms})
    tool_call_observe(toolset=tool.toolset.key, ok=reply["ok"], seconds=(timezone.now() - call.started_at).total_seconds())
    if not finished:
        # The bridge gave up on it meanwhile (and told the watchers): the record's word is final.
        _tool_call_recorded_push(call_id)


@dataclass(frozen=True)
class _Ran:
    """A call that ran on this worker, its reply for the code, and whether it is billed: a price was
    held for it as it was made."""

    call: ToolCall
    reply: dict[str, Any]
    billed: bool


def _tool_call_finish_alone(ran: _Ran, *, renew: bool) -> bool:
    """Finish a call that ran, alone, waiting on a lock BRIEF_LOCK_WAIT_MS at most; with ``renew``
    (tried again), renewing its lease first."""
    if renew:
        _tool_calls_renew([ran.call.call_id])
    return _tool_calls_finish_ran([ran], brief=True)[0]


# How many of this process's pooled connections the tries of finishes that wait out a row held
# locked take at once: a quarter of PTC_DB_POOL_MAX. A try holds one for BRIEF_LOCK_WAIT_MS at most,
# and gives it back while it waits for the next (db_retry, a second at most); without a bound, the
# tries of a worker's many such calls, which start together, took the whole pool at times.
_lock_turns = threading.BoundedSemaphore(max(1, settings.PTC_DB_POOL_MAX // 4))


class _LockWaits:
    """The tries of one call's finish, claim or failure (``__call__`` runs one): once one was
    cancelled waiting on a lock (its account's or its user's row held by a transaction stuck
    elsewhere), each of the next takes one of the process's few turns (``_lock_turns``), so that
    however many calls wait, on however many accounts, the rest of the pool is other calls'. Not its
    first try alone, which may be a call batched with the one the lock holds (it goes at once), nor
    a try in an outage (no lock to wait on)."""

    def __init__(self) -> None:
        self.locked = False

    def __call__(self, work: Callable[[], T]) -> T:
        with _lock_turns if self.locked else nullcontext():
            try:
                return work()
            except (OperationalError, InterfaceError) as exc:
                self.locked = statement_cancelled(exc)
                db_reset()  # its connection back to the pool before its turn is another's
                raise


def _tool_calls_finish_ran(batch: list[_Ran], *, brief: bool = False) -> list[bool]:
    """Record the outcomes of calls that ran (settling or releasing their credits), then push
    each result to its code and, after all of them, each event to the job's watchers, in one
    round trip. Return whether each call was finished here (False: it had finished already).

    On PostgreSQL the batch is one UPDATE (and a settle per billed call, in its transaction);
    elsewhere it is a call at a time. With ``brief`` (a batch of this worker's, or a call tried again
    alone), a lock is waited on BRIEF_LOCK_WAIT_MS at most, as ``_tool_calls_claim`` has it."""
    if connection.vendor == "postgresql":
        finished = _tool_calls_finish_postgres(batch, brief=brief)
    else:
        finished = [
            tool_call_finish(
                call_id=ran.call.call_id,
                output=ran.reply.get("result"),
                error=ran.reply.get("error"),
                billed=ran.billed,
                event=False,
                record=ran.call,
            )
            for ran in batch
        ]
    done = [ran for ran, ok in zip(batch, finished, strict=True) if ok]
    backplane().publish_then_append(
        [(_result_channel(r.call.call_id, r.call.ptc_call_id), Result(call_id=r.call.call_id, **r.reply)) for r in done],
        [(r.call.ptc_call_id, [tool_call_event(r.call)]) for r in done if r.call.ptc_call_id],
    )
    return finished


def _tool_calls_finish_postgres(batch: list[_Ran], *, brief: bool = False) -> list[bool]:
    """``tool_call_finish`` for a batch, on PostgreSQL: the calls' rows, the settle of the billed ones
    that completed and the release of those that failed, in one statement when they are one user's
    (a job's usually are); else one UPDATE, then a statement per user in the same transaction.

    A call is billed as it was made, as ``tool_call_finish`` has it: one whose price was held is
    settled or released even if its toolset turned free or private while it was queued (its claim
    said whether a price was held: ``_Ran.billed``). A failed one's hold is given back with its
    record, as a completed one's is settled: an account's row held locked then cancels the batch
    (``brief``), which goes again call by call, as for any other lock it meets. Given back after the
    record, a hold whose account's row was held locked could not be waited for without holding up
    the batch's other calls: it cost the batch ``BRIEF_LOCK_WAIT_MS`` a call, and was left held
    until the reaper's close of held credits a lease later."""
    now = timezone.now()
    fields = [_finished_fields(output=ran.reply.get("result"), error=ran.reply.get("error"), now=now) for ran in batch]
    settles = [ran.billed and not f["error"] for ran, f in zip(batch, fields, strict=True)]
    releases = [ran.billed and bool(f["error"]) for ran, f in zip(batch, fields, strict=True)]
    # The batch as one JSON parameter: as seven arrays, the statement took 0.25 ms more (a half of
    # that psycopg's adapting of them, the rest PostgreSQL's unnesting), a third of its time.
    calls = [
        {"call_id": ran.call.call_id, "status": f["status"].value, "output": f["output"], "error": f["error"]}
        | {"settles": settle, "releases": release}
        for ran, f, settle, release in zip(batch, fields, settles, releases, strict=True)
    ]
    params: dict[str, Any] = {"now": now, "calls": json.dumps(calls), "lock_wait": brief_lock_wait(brief)}
    payers = {ran.call.user_id for ran, settle, release in zip(batch, settles, releases, strict=True) if settle or release}
    if len(payers) <= 1:
        # One statement is atomic on its own; its one account row is locked only while it runs.
        with connection.cursor() as cursor:
            cursor.execute(_FINISH_CLOSE_SQL if any(releases) else _FINISH_SETTLE_SQL if payers else _FINISH_SQL, params)
            credits = dict(cursor.fetchall())
    else:
        # Each account's row is locked from its statement (one per user) to the commit: accounts go
        # in one order (by user), so two batches never wait on each other in a cycle. The lock_timeout
        # the first statement set (brief) is the transaction's: these wait on a lock as briefly.
        with transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute(_FINISH_SQL, params)
                credits = dict(cursor.fetchall())
            ended = [(ran, settle) for ran, settle, release in zip(batch, settles, releases, strict=True) if settle or release]
            _holds_close([(ran.call.user_id, ran.call.call_id, settle) for ran, settle in ended if ran.call.call_id in credits])
    for ran, values in zip(batch, fields, strict=True):
        if ran.call.call_id in credits:
            _record_finished(ran.call, values, credits[ran.call.call_id])
    return [ran.call.call_id in credits for ran in batch]


# A batch waits on a lock briefly: a call whose finish waits longer is finished again alone (_tool_call_run).
_finishes = GroupCommit(functools.partial(_tool_calls_finish_ran, brief=True))


def tool_calls_close_held() -> None:
    """Settle or release the credits a dead worker left held, by how each call ended. A call with
    no record yet is queued for a tools worker (which records it as it claims it) while its job
    runs; once its job has ended it can never run, and what was held for it goes back. A call whose
    account's row is held locked waits for a later round (unless_locked: a moment's wait, not
    PTC_DB_STATEMENT_TIMEOUT's, for each such call)."""
    for call_id in reservations_held(older_than_seconds=settings.PTC_JOB_LEASE_SECONDS):
        unless_locked(functools.partial(_tool_call_close_held, call_id), what="closing a call's hold", call_id=call_id)


def _tool_call_close_held(call_id: str) -> None:
    status = ToolCall.objects.filter(call_id=call_id).values_list("status", flat=True).first()
    if status == ToolCall.Status.COMPLETED:
        with transaction.atomic():
            # Only if this settled it: a call that completed after the list was read was settled
            # by its finish, which recorded what it charged (a settle now charges, and says, 0).
            charged = credits_settle_many(tool_call_ids=[call_id])
            if call_id in charged:
                ToolCall.objects.filter(call_id=call_id).update(credits=charged[call_id])
    elif status is None:
        if not Reservation.objects.filter(tool_call_id=call_id, exec_job__status=ExecJob.Status.RUNNING).exists():
            credits_release(tool_call_id=call_id)
    elif status not in ToolCall.OPEN:  # a call awaiting its approval holds its price until decided
        credits_release(tool_call_id=call_id)


# The calls whose rows this process's reaper found held locked: their workers' renewals waited on the lock.
_reaper_found_locked = LockedRows(ToolCall, "call_id")


def tool_calls_reap() -> None:
    """Fail the calls whose tools worker stopped renewing their lease (it died), and tell their
    code at once: ``worker_lost``, never run again."""
    stale = timezone.now() - timedelta(seconds=settings.PTC_JOB_LEASE_SECONDS)
    lapsed = (
        ToolCall.objects.filter(status=ToolCall.Status.EXECUTING, claimed_at__isnull=False)
        .annotate(lease=Coalesce("heartbeat_at", "claimed_at"))
        .filter(lease__lt=stale)
    )
    lapsed_calls = list(lapsed.values_list("call_id", "ptc_call_id"))
    _reaper_found_locked.keep_only({call_id for call_id, _ in lapsed_calls})
    judged = [(call_id, ptc_call_id) for call_id, ptc_call_id in lapsed_calls if not _reaper_found_locked.waits(call_id)]
    # Those whose tool ran, their outcome kept by their task's last retry: recorded, not worker_lost.
    kept = backplane().outcomes_kept([call_id for call_id, _ in judged])
    for call_id, ptc_call_id in judged:
        if call_id in kept:
            record = functools.partial(_tool_call_kept_record, call_id, kept[call_id])
            recorded = unless_locked(record, what="recording a call's outcome kept", call_id=call_id)
            if recorded is None:
                _reaper_found_locked.held(call_id)
            if recorded is not False:
                continue
        logger.warning("a tools worker stopped renewing a call's lease; failing it", extra={"call_id": call_id})
        fail = functools.partial(_tool_call_fail, call_id, "worker_lost", WORKER_LOST_MESSAGE)
        reply = unless_locked(fail, what="failing a call whose worker stopped", call_id=call_id)
        if reply is None:
            _reaper_found_locked.held(call_id)
        else:
            backplane().publish(_result_channel(call_id, ptc_call_id), Result(call_id=call_id, **reply))
