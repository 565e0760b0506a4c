"""The bridge adapter: what a job's sandbox session calls to check, record and dispatch its tool
calls, and to read their outcome from the records when a push was lost."""

import logging
import uuid
from typing import Any

from django.conf import settings
from django.db import InterfaceError, OperationalError, connection
from django.utils import timezone

from execution.backplane import Approved
from execution.models import ExecJob, ToolCall
from execution.sandbox.session import Dispatched, Granted, Looked, Refused
from execution.selectors import calls_overdue_at
from execution.services.calls import (
    CALL_TIMEOUT_MESSAGE,
    JOB_ENDED_MESSAGE,
    CallChecker,
    approved_call_timeout,
    tool_call_build,
    tool_call_finish,
    tool_call_reply,
    tool_calls_enqueue,
    tool_calls_fail_queued,
    tool_calls_record,
    tool_calls_reserve,
    tool_needs_approval,
    tool_run_timeout,
)
from ptcproject.db import db_reset
from ptcproject.errors import call_error
from ptcproject.policy.models import Policy
from tools.errors import ToolFailure
from tools.models import Tool, Toolset

# The status a call is recorded in by what it waits on (JobCallRouter._awaits).
AWAITING_STATUS = {"client": ToolCall.Status.AWAITING_CLIENT, "approval": ToolCall.Status.AWAITING_APPROVAL}

logger = logging.getLogger("ptc.execution")


class _Counted:
    """An execute wrapper (``connection.execute_wrapper``) counting the statements that ran, and
    whether the first one failed because its connection was found dead (``lost``)."""

    def __init__(self) -> None:
        self.count = 0
        self.lost = False

    def __call__(self, execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        try:
            result = execute(sql, params, many, context)
        except (OperationalError, InterfaceError):
            # Seen here, as it fails: inside a transaction (a credit cap's lock of the account) the
            # rollback that follows fails too, and Django lets go of the connection before the caller looks.
            raw = context["connection"].connection
            self.lost = not self.count and raw is not None and bool(getattr(raw, "closed", False))
            raise
        self.count += 1
        return result


class JobCallRouter:
    """Checks and dispatches one job's tool calls from its sandbox: check, record, enqueue."""

    def __init__(
        self,
        *,
        job: ExecJob,
        toolsets: list[Toolset],
        direct_only: frozenset[str],
        extra: list[tuple[Toolset, list[Tool]]] | None = None,
        policy: Policy | None = None,
    ) -> None:
        self.job = job
        granted = [ts for ts in toolsets if ts.key in job.toolsets]
        self.checker = CallChecker(user=job.user, toolsets=granted, direct_only=direct_only, ptc_only=True, extra=extra)
        self.quotes: dict[Any, Any] = {}
        self.policy = policy
        # The calls sent to tools workers unrecorded (their worker records each as it claims it),
        # for when the bridge gives up on one (``overdue``) or the job ends first (``closed``).
        self.queued: dict[str, ToolCall] = {}
        self._announced = False  # whether the burst being submitted has been announced (submit_many)

    def _awaits(self, tool: Tool) -> str:
        """Return what a call of ``tool`` waits on before it can end: ``client`` (the caller runs
        it), ``approval`` (someone must approve it first), or ``""`` (it runs on a tools worker)."""
        if tool.toolset.kind == Toolset.Kind.CLIENT:
            return "client"
        return "approval" if self.policy is not None and tool_needs_approval(tool=tool, policy=self.policy) else ""

    def submit_many(self, requests: list[tuple[str, str, Any]]) -> list[Dispatched | Refused]:
        """Check, record, reserve and enqueue a burst of calls ``(toolset, tool, arguments)``: one
        INSERT, one round trip of events, one producer. Return each one's outcome, in order."""
        try:
            # The pool hands out a connection used within the last second unchecked
            # (ptcproject/pgcheck.py): the first statement sent on one whose backend went meanwhile
            # (a restart, a killed backend) fails, and these calls failed with it, the code seeing
            # internal_error. Nothing of them was done if no statement ran: they are submitted
            # again, on the next connection, as long as each is found dead (at most the pool's
            # size); a database that can't be reached at all fails them. Not once they were announced
            # (their start events out, and maybe their messages queued): they are theirs for good.
            for _ in range(settings.PTC_DB_POOL_MAX):
                ran = _Counted()
                self._announced = False
                try:
                    with connection.execute_wrapper(ran):
                        return self._submit_many(requests)
                except (OperationalError, InterfaceError):
                    if ran.count or not ran.lost or self._announced:
                        raise
                    logger.warning("a pooled database connection was found dead before any call was recorded; submitting again")
                    db_reset()
            return self._submit_many(requests)
        finally:
            connection.close()  # this runs on a session's submit thread: give its connection back to the pool

    def _submit_many(self, requests: list[tuple[str, str, Any]]) -> list[Dispatched | Refused]:
        calls: list[ToolCall] = []
        found_tools: list[Tool | None] = []
        for toolset, tool, arguments in requests:
            fields = {
                "call_id": f"ptc_{uuid.uuid4().hex}",
                "user": self.job.user,
                "job": self.job,
                "toolset": toolset,
                "tool": tool,
                "arguments": arguments,
            }
            try:
                found = self.checker.check(toolset, tool, arguments)
                status = AWAITING_STATUS.get(self._awaits(found), ToolCall.Status.EXECUTING)
                calls.append(tool_call_build(**fields, found=found, status=status))
            except ToolFailure as failure:
                found = None
                calls.append(tool_call_build(**fields, found=None, error=failure.as_dict()))
            found_tools.append(found)
        # Prices are held before anything is recorded: a call refused for its price is recorded
        # failed. A job's own client tools are free (no row, no price); a shared client toolset's
        # or an approval's price is held while it waits, and settled when it completes.
        priced = [
            (call.call_id, found) for call, found in zip(calls, found_tools, strict=True) if found and not found._state.adding
        ]
        refused = tool_calls_reserve(calls=priced, user=self.job.user, job=self.job, quotes=self.quotes)
        outcomes: list[Dispatched | Refused] = []
        accepted: list[tuple[str, str]] = []
        queued: dict[str, ToolCall] = {}
        for call, found in zip(calls, found_tools, strict=True):
            if call.call_id in refused:
                call.status, call.error, call.finished_at = ToolCall.Status.FAILED, refused[call.call_id], call.started_at
            if found is None or call.status == ToolCall.Status.FAILED:
                assert call.error is not None, "a refused call was built or marked with its failure as its error"
                outcomes.append(Refused(call_id=call.call_id, error=call.error))
            elif awaits := self._awaits(found):
                # Nothing is queued: the call waits for POST .../tool-results or .../approval.
                timeout = found.timeout or settings.PTC_CLIENT_TOOL_TIMEOUT
                outcomes.append(Dispatched(call_id=call.call_id, timeout=timeout, awaiting=awaits))
            else:
                outcomes.append(Dispatched(call_id=call.call_id, timeout=tool_run_timeout(found)))
                # found.toolset is the checker's own row (prefetched with its tools): no query here.
                accepted.append((call.call_id, found.toolset.queue))
                queued[call.call_id] = call
        # The calls for tools workers are announced here and recorded by the worker that claims
        # each; the others (refused, or waiting on a person) are recorded here.
        # A lone call's start event goes to Redis with its message, in one round trip (tool_calls_enqueue).
        # In a burst they go with the others' events, as they are in the order of their calls.
        written, starts = tool_calls_record(calls, queued=frozenset(queued), starts_held=len(calls) == 1)
        for call_id in written:
            del queued[call_id]  # recorded after all (its large input is read back from the record)
        self._announced = True
        self.queued.update(queued)
        errors = tool_calls_enqueue(accepted, queued=queued, starts=starts)
        return [Refused(call_id=o.call_id, error=errors[o.call_id]) if o.call_id in errors else o for o in outcomes]

    def lookup(self, *, call_id: str) -> Looked:
        """What the record says of an open call whose push may have been lost (the channel
        reconnected): its reply if it has finished, and if it was approved, ``Approved`` and how
        long ago (its job's clock runs from then, though it may have finished since); nothing
        while it waits or runs unapproved, or while the database can't say (its deadline holds)."""
        try:
            call = ToolCall.objects.select_related("tool").filter(call_id=call_id).first()
        except (OperationalError, InterfaceError):
            db_reset()
            return Looked()
        if call is None:
            return Looked()
        reply = tool_call_reply(call) if call.status not in ToolCall.OPEN else None
        if call.decision != ToolCall.Decision.APPROVED or call.decided_at is None:
            return Looked(reply=reply)
        ago = max(0.0, (timezone.now() - call.decided_at).total_seconds())
        return Looked(reply=reply, approved=Approved(call_id=call_id, timeout=approved_call_timeout(call)), approved_ago=ago)

    def overdue(self, *, call_id: str) -> dict[str, Any] | float:
        # The hand-off was lost or the call is stuck: the record decides. A late tools worker
        # finds the call failed and its result is dropped; so does a late client or approver.
        error = call_error("tool_timeout", CALL_TIMEOUT_MESSAGE)
        try:
            # Its tools worker runs it by its tool's timeout as it is, from its claim: one raised
            # since the job started (which the bridge's deadline counted) is not overdue yet.
            running = ToolCall.objects.filter(call_id=call_id, status=ToolCall.Status.EXECUTING)
            until = calls_overdue_at(running)
            if until is not None and (left := (until - timezone.now()).total_seconds()) > 0:
                return left
            status = ToolCall.objects.filter(call_id=call_id).values_list("status", flat=True).first()
            if status == ToolCall.Status.AWAITING_CLIENT:
                error = call_error("tool_timeout", "the client did not post this call's result within its timeout")
            elif status == ToolCall.Status.AWAITING_APPROVAL:
                error = call_error("tool_timeout", "nobody approved or denied this call within its timeout")
            if call_id in self.queued:  # recorded failed if no worker ever recorded it
                tool_calls_fail_queued([self.queued[call_id]], error=error, running=True)
            else:
                tool_call_finish(call_id=call_id, error=error)
            return tool_call_reply(ToolCall.objects.get(call_id=call_id))
        except (OperationalError, InterfaceError):
            # The code gets its answer now; the record, still executing, is failed by the reaper.
            logger.warning("could not record an overdue call: the database is unreachable", extra={"call_id": call_id})
            db_reset()
            return {"ok": False, "error": error}

    def granted(self, *, toolset: str, tool: str) -> Granted | dict[str, str]:
        # What the checker holds: the toolsets resolved as the job started, with their tools then.
        # No statement: their tools were read with them.
        found_toolset = self.checker.toolsets.get(toolset)
        if found_toolset is None:
            return call_error("toolset_not_granted", f"toolset '{toolset[:64]}' was not granted to job {self.job.call_id}")
        if toolset in self.checker.extra_tools or found_toolset.kind == Toolset.Kind.CLIENT:
            message = f"'{toolset}.{tool[:128]}' is a client tool: its caller runs it; there is nothing to run here"
            return call_error("kind_unsupported", message)
        found = next((t for t in found_toolset.tools.all() if t.name == tool), None)
        if found is None:
            return call_error("unknown_tool", f"toolset '{toolset}' has no tool '{tool[:128]}'")
        return Granted(tool_id=str(found.pk), timeout=tool_run_timeout(found))

    def calls_open(self, *, call_ids: list[str]) -> dict[str, bool] | None:
        try:
            found = ToolCall.objects.filter(call_id__in=call_ids, exec_job=self.job).values_list("call_id", "status")
            return {call_id: status in ToolCall.OPEN for call_id, status in found}
        except (OperationalError, InterfaceError):
            db_reset()
            return None

    def calls_fence(self, *, epoch: int) -> bool:
        # Its own statement, committed at once: it waits for a call being recorded (which holds the
        # job's row), and a call recorded after it reads the new epoch under the same lock.
        try:
            ExecJob.objects.filter(pk=self.job.pk).update(http_admit_epoch=epoch)
            return True
        except (OperationalError, InterfaceError):
            db_reset()
            return False

    def closed(self, *, open_calls: list[str]) -> None:
        """The job ended with ``open_calls`` unanswered: those sent to a tools worker that none has
        taken are recorded as never run (one a worker took, it finishes)."""
        calls = [self.queued[call_id] for call_id in open_calls if call_id in self.queued]
        if calls:
            tool_calls_fail_queued(calls, error=call_error("job_ended", JOB_ENDED_MESSAGE), running=False)
