"""Writes for calls that wait on a person rather than a worker: a client tool's result posted by the
job's caller (``POST /exec/{id}/tool-results``), and an approval or denial
(``POST /tool-calls/{call_id}/approval``, or the admin's timeline).

Each answer claims its call with one conditional UPDATE (``WHERE status = 'awaiting_...'``): of two
answers to the same call, one wins and the other is refused (409) and changes nothing. The outcome
is pushed to the waiting sandbox on the job's channel, and published as the call's event.
"""

import json
import logging
from collections import Counter
from typing import Any

from django.conf import settings
from django.contrib.auth.models import User
from django.db import transaction
from django.utils import timezone

from billing.services import billable
from execution.backplane import Approved, Result, backplane, job_channel
from execution.events import event_publish, tool_call_payload
from execution.models import ExecJob, ToolCall
from execution.selectors import tool_call_is_client
from execution.services.calls import (
    approved_call_timeout,
    call_job_running,
    tool_call_finish,
    tool_call_reply,
    tool_calls_enqueue,
)
from ptcproject import queues
from ptcproject.errors import ApplicationError, call_error
from ptcproject.storage import storable, unstorable

logger = logging.getLogger("ptc.execution")
# How much of a failed client result's content its recorded error message keeps.
ERROR_MESSAGE_CHARS = 2000


def client_content(content: Any) -> Any:
    """Return what the code gets for a client's ``content``: a list of Anthropic text blocks
    (``[{"type": "text", "text": ...}]``) becomes their joined text; any other JSON value is passed as is."""
    if (
        isinstance(content, list)
        and content
        and all(isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str) for b in content)
    ):
        return "".join(b["text"] for b in content)
    return content


def _job_ended_refusal(call: ToolCall, job: ExecJob) -> ApplicationError:
    return ApplicationError(
        "call_not_awaiting",
        f"Call {call.call_id} takes no answer: its job has ended ('{job.status}'), and its end closes its calls.",
        status=409,
        details={"tool_use_id": call.call_id, "job_status": job.status},
    )


def _claim_refusal(call: ToolCall) -> ApplicationError:
    """Return why a result for ``call`` can't be taken: answered already, or not waiting on a client."""
    # claimed_at on a client call is set by the answer that won it (no tools worker claims one).
    if call.status in (ToolCall.Status.COMPLETED, ToolCall.Status.FAILED) and call.claimed_at and tool_call_is_client(call):
        return ApplicationError(
            "result_conflict",
            f"Call {call.call_id} already has its result; a second answer changes nothing.",
            status=409,
            details={"tool_use_id": call.call_id, "status": call.status},
        )
    return ApplicationError(
        "call_not_awaiting",
        f"Call {call.call_id} is not waiting for a client result (its status is '{call.status}').",
        status=409,
        details={"tool_use_id": call.call_id, "status": call.status},
    )


def tool_results_submit(*, job: ExecJob, results: list[dict[str, Any]]) -> list[ToolCall]:
    """Record the client's results ``[{tool_use_id, content, is_error}]`` for ``job``'s calls that
    wait on it, all or none, push each to the waiting code and publish its event. Return the calls.

    Raise ApplicationError: ``validation_error`` (400) for an id given twice or content over
    PTC_MAX_TOOL_OUTPUT_BYTES, ``call_not_found`` (404) for an id that is no call of this job,
    ``call_not_awaiting`` (409) for a call that is not waiting on the client (a server tool's, or
    one that timed out or ended with its job),
    ``result_conflict`` (409) for a call already answered.
    """
    ids = [r["tool_use_id"] for r in results]
    repeated = sorted(i for i, n in Counter(ids).items() if n > 1)
    if repeated:
        raise ApplicationError(
            "validation_error", "Each tool_use_id may appear once.", details={"tool_use_id": [f"repeated: {', '.join(repeated)}"]}
        )
    unfit = [f"{r['tool_use_id']}: {problem}" for r in results if (problem := unstorable(r.get("content")))]
    if unfit:  # the code gets a result as it is recorded: never changed to fit
        raise ApplicationError(
            "validation_error", f"A result's content can't be stored as given: {unfit[0]}.", details={"content": unfit}
        )
    limit = settings.PTC_MAX_TOOL_OUTPUT_BYTES
    large = [r["tool_use_id"] for r in results if len(json.dumps(r.get("content"))) > limit]
    if large:  # what a server tool may return at most; more would not fit the sandbox's bridge either
        raise ApplicationError(
            "validation_error",
            f"A result's content is over {limit} bytes of JSON; send less.",
            details={"content": [f"over {limit} bytes: {', '.join(large)}"]},
        )
    calls = {c.call_id: c for c in ToolCall.objects.filter(exec_job=job, call_id__in=ids).select_related("tool__toolset")}
    missing = [i for i in ids if i not in calls]
    if missing:
        raise ApplicationError(
            "call_not_found",
            f"No call of job {job.call_id} has the id {', '.join(missing)}: answer with the id of its tool_call_pending event.",
            status=404,
            details={"tool_use_id": missing},
        )
    for call_id in ids:
        if calls[call_id].status != ToolCall.Status.AWAITING_CLIENT:
            raise _claim_refusal(calls[call_id])
    now = timezone.now()
    replies: dict[str, dict[str, Any]] = {}
    # All or none: a call claimed meanwhile by another answer (or its timeout) undoes the lot.
    # Claimed in one order whatever the request's (by id): two answers to the same calls listed in
    # other orders would each hold a row the other waits for, and PostgreSQL would fail one (a 503).
    with transaction.atomic():
        for result in sorted(results, key=lambda r: r["tool_use_id"]):
            call = calls[result["tool_use_id"]]
            content = client_content(result.get("content"))
            error = None
            if result.get("is_error"):
                text = content if isinstance(content, str) else json.dumps(content)
                error = call_error("client_error", text[:ERROR_MESSAGE_CHARS] or "the client reported an error")
            billed = call.tool is not None and billable(toolset=call.tool.toolset, tool=call.tool)
            claimed = tool_call_finish(
                call_id=call.call_id,
                output=content,
                error=error,
                billed=billed,
                event=False,
                record=call,
                from_statuses=(ToolCall.Status.AWAITING_CLIENT,),
                extra={"claimed_at": now},
                job_running=True,  # its job may have ended (a cancel) while the call still waits
            )
            if not claimed:
                call.refresh_from_db()
                job.refresh_from_db(fields=["status"])
                raise _claim_refusal(call) if call.status != ToolCall.Status.AWAITING_CLIENT else _job_ended_refusal(call, job)
            replies[call.call_id] = tool_call_reply(call)
    for call_id in ids:
        call = calls[call_id]
        backplane().publish(job_channel(job.call_id), Result(call_id=call_id, **replies[call_id]))
        event_publish(
            job_call_id=job.call_id,
            event="tool_call_end" if call.status == ToolCall.Status.COMPLETED else "tool_call_error",
            data=tool_call_payload(call),
        )
    logger.info("client results recorded", extra={"job_id": str(job.pk), "calls": ids})
    return [calls[i] for i in ids]


def tool_call_decide(*, call: ToolCall, actor: User, approve: bool, reason: str = "") -> ToolCall:
    """Approve or deny a call that waits for an approval, as ``actor`` (staff or the job's owner;
    the caller checks). Approved, it is queued to run as usual; denied, it fails ``denied`` and the
    code gets ``ToolError(code="denied")``. Who, when and why are recorded on the call. Return it.

    Raise ApplicationError ``decision_conflict`` (409) if it was decided already, ``call_not_awaiting``
    (409) if it is not waiting for an approval.
    """
    decided = {
        "decision": ToolCall.Decision.APPROVED if approve else ToolCall.Decision.DENIED,
        "decided_by": actor,
        "decided_at": timezone.now(),
        "decision_reason": storable(reason[:500]),  # as typed in the timeline's form: a NUL can't be stored
    }
    if approve:
        awaiting = ToolCall.objects.filter(call_job_running(), pk=call.pk, status=ToolCall.Status.AWAITING_APPROVAL)
        claimed = bool(awaiting.update(status=ToolCall.Status.EXECUTING, **decided))
    else:
        who = f" by {actor.get_username()}" + (f": {reason}" if reason else "")
        claimed = tool_call_finish(
            call_id=call.call_id,
            error=call_error("denied", f"the call was denied{who}"),
            from_statuses=(ToolCall.Status.AWAITING_APPROVAL,),
            extra=decided,
            job_running=True,
        )
    call.refresh_from_db()
    if not claimed and call.status == ToolCall.Status.AWAITING_APPROVAL and call.exec_job is not None:
        raise _job_ended_refusal(call, call.exec_job)  # its job ended: its end closes it
    if not claimed:
        if call.decision:
            raise ApplicationError(
                "decision_conflict",
                f"Call {call.call_id} was already {call.decision}; a second decision changes nothing.",
                status=409,
                details={"decision": call.decision},
            )
        raise ApplicationError(
            "call_not_awaiting",
            f"Call {call.call_id} is not waiting for an approval (its status is '{call.status}').",
            status=409,
            details={"status": call.status},
        )
    channel = job_channel(call.ptc_call_id)
    if approve:
        # Queued like any call: a tools worker claims it (its job must still be running) and
        # pushes its result; the sandbox now gives it the tool's own timeout.
        # Its approval is in the job's log before the call can run: a tools worker quick to take it
        # would otherwise log its end first. One that can't be queued then ends failed, after it.
        event_publish(job_call_id=call.ptc_call_id, event="tool_call_approved", data=tool_call_payload(call))
        queue = call.tool.toolset.queue if call.tool else queues.TOOLS
        errors = tool_calls_enqueue([(call.call_id, queue)])
        if call.call_id in errors:
            call.refresh_from_db()
            backplane().publish(channel, Result(call_id=call.call_id, ok=False, error=errors[call.call_id]))
        else:
            backplane().publish(channel, Approved(call_id=call.call_id, timeout=approved_call_timeout(call)))
    else:
        backplane().publish(channel, Result(call_id=call.call_id, **tool_call_reply(call)))
    logger.info("tool call %s", call.decision, extra={"call_id": call.call_id, "by": actor.get_username()})
    return call
