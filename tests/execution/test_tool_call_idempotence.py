"""The tools task under redelivery and cancel: a call runs at most once, and never for an ended job."""

import copy
import uuid
from datetime import timedelta
from typing import Any

import pytest
from django.conf import settings
from django.contrib.auth import get_user_model
from django.utils import timezone

from billing.models import Reservation
from execution.backplane import backplane, job_channel
from execution.models import ExecJob, ToolCall
from execution.services import calls as services
from tests.factories import demo_call, running_job
from tools.models import Tool, Toolset


@pytest.fixture
def running_call() -> ToolCall:
    user = get_user_model().objects.create_user(username=f"idem-{uuid.uuid4().hex[:6]}")
    return demo_call(user=user, job=running_job(user=user))


@pytest.fixture
def runs(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    calls: list[dict[str, Any]] = []
    real = services.tool_run

    def counting(**kwargs: Any) -> Any:
        calls.append(kwargs["arguments"])
        return real(**kwargs)

    monkeypatch.setattr(services, "tool_run", counting)
    return calls


def test_a_redelivered_task_runs_the_tool_once(running_call: ToolCall, runs: list) -> None:
    services.tool_call_execute(call_id=running_call.call_id)
    first = ToolCall.objects.get(pk=running_call.pk)
    services.tool_call_execute(call_id=running_call.call_id)  # the broker delivers it again
    second = ToolCall.objects.get(pk=running_call.pk)
    assert len(runs) == 1
    assert (first.status, first.output) == ("completed", 3)
    assert (second.status, second.output, second.finished_at) == ("completed", 3, first.finished_at)
    assert ToolCall.objects.filter(call_id=running_call.call_id).count() == 1


def test_a_task_redelivered_after_its_worker_died_is_not_run_again(running_call: ToolCall, runs: list) -> None:
    # Claimed, then the worker died: its lease lapsed.
    lapsed = timezone.now() - timedelta(seconds=settings.PTC_JOB_LEASE_SECONDS + 1)
    ToolCall.objects.filter(pk=running_call.pk).update(claimed_at=lapsed)
    services.tool_call_execute(call_id=running_call.call_id)
    call = ToolCall.objects.get(pk=running_call.pk)
    assert runs == []
    assert call.status == "failed"
    assert call.error["code"] == "worker_lost"


def test_a_duplicate_delivery_while_the_call_runs_leaves_it_running(running_call: ToolCall, runs: list) -> None:
    # Claimed by a worker that renews its lease (it is running the call), then delivered again.
    ToolCall.objects.filter(pk=running_call.pk).update(
        claimed_at=timezone.now() - timedelta(seconds=60), heartbeat_at=timezone.now()
    )
    with backplane().subscribe(job_channel(running_call.ptc_call_id)) as channel:
        services.tool_call_execute(call_id=running_call.call_id)
        channel.wait(0.5)
        assert channel.drain() == [], "the running call's code was told something"
    call = ToolCall.objects.get(pk=running_call.pk)
    assert runs == []
    assert (call.status, call.error) == ("executing", None)


def test_a_call_queued_for_a_cancelled_job_is_not_run(running_call: ToolCall, runs: list) -> None:
    ExecJob.objects.filter(pk=running_call.exec_job_id).update(status="cancelled")
    services.tool_call_execute(call_id=running_call.call_id)
    call = ToolCall.objects.get(pk=running_call.pk)
    assert runs == []
    assert call.status == "failed"
    assert call.error["code"] == "job_ended"


# -- A job's calls, recorded by the claim that takes them ------------------------------------------
@pytest.fixture
def queued_call() -> ToolCall:
    """A job's call of Demo.add as its bridge sends it: announced, its price held, not recorded."""
    from ptcproject.accounts.services import user_with_key_create

    user, _ = user_with_key_create(username=f"queued-{uuid.uuid4().hex[:6]}", create_user=True, staff=False, credits=10)
    job = running_job(user=user)
    tool = Tool.objects.select_related("toolset").get(toolset__key="demo", toolset__owner=None, name="add")
    call = services.tool_call_build(
        call_id=f"ptc_{uuid.uuid4().hex}", user=user, job=job, toolset="demo", tool="add", arguments={"a": 1, "b": 2}, found=tool
    )
    assert services.tool_calls_reserve(calls=[(call.call_id, tool)], user=user, job=job) == {}
    return call


def _held(call: ToolCall) -> str:
    return Reservation.objects.get(tool_call_id=call.call_id).status


def test_a_queued_call_is_recorded_by_its_claim_and_runs_once(queued_call: ToolCall, runs: list) -> None:
    record = services.tool_call_signed(queued_call)
    services.tool_call_execute(call_id=queued_call.call_id, record=record)
    services.tool_call_execute(call_id=queued_call.call_id, record=record)  # the broker delivers it again
    call = ToolCall.objects.get(call_id=queued_call.call_id)
    assert len(runs) == 1
    assert (call.status, call.output, call.credits, call.input) == ("completed", 3, 1, {"a": 1, "b": 2})
    assert (call.started_at, call.exec_job_id, call.tool_id) == (
        queued_call.started_at,
        queued_call.exec_job_id,
        queued_call.tool_id,
    )
    assert call.claimed_at is not None and call.claimed_at >= call.started_at
    assert _held(call) == "settled"


def test_a_queued_call_whose_job_ended_is_recorded_as_never_run(queued_call: ToolCall, runs: list) -> None:
    ExecJob.objects.filter(pk=queued_call.exec_job_id).update(status="cancelled")
    with backplane().subscribe(job_channel(queued_call.ptc_call_id)) as channel:
        services.tool_call_execute(call_id=queued_call.call_id, record=services.tool_call_signed(queued_call))
        channel.wait(2)
        replies = channel.drain()
    call = ToolCall.objects.get(call_id=queued_call.call_id)
    assert runs == []
    assert (call.status, call.error["code"], call.claimed_at) == ("failed", "job_ended", None)
    assert [r.call_id for r in replies] == [call.call_id] and replies[0].error["code"] == "job_ended"
    assert _held(call) == "released"


def test_a_forged_record_is_neither_run_nor_recorded(queued_call: ToolCall, runs: list) -> None:
    signed = services.tool_call_signed(queued_call)
    forged = signed.replace('"a":1', '"a":1000')  # the input changed, the signature kept
    assert forged != signed
    with backplane().subscribe(job_channel(queued_call.ptc_call_id)) as channel:
        services.tool_call_execute(call_id=queued_call.call_id, record=forged)
        channel.wait(2)
        replies = channel.drain()
    assert runs == []
    assert not ToolCall.objects.filter(call_id=queued_call.call_id).exists()
    assert [r.error["code"] for r in replies] == ["internal_error"]
    assert "DJANGO_SECRET_KEY" in replies[0].error["message"]


def test_a_job_that_ends_first_records_its_untaken_calls_as_never_run(queued_call: ToolCall, runs: list) -> None:
    # A second call of the same job that a worker took and is running: the job's end leaves it be.
    taken = copy.copy(queued_call)
    taken.call_id = f"ptc_{uuid.uuid4().hex}"
    assert services._claims((taken.call_id, taken)) is not None
    failed = services.tool_calls_fail_queued([queued_call, taken], error={"code": "job_ended", "message": "x"}, running=False)
    assert failed == [queued_call.call_id]
    assert ToolCall.objects.get(call_id=taken.call_id).status == "executing"
    assert (ToolCall.objects.get(call_id=queued_call.call_id).status, _held(queued_call)) == ("failed", "released")
    # Its task, delivered later, finds it ended and runs nothing.
    services.tool_call_execute(call_id=queued_call.call_id, record=services.tool_call_signed(queued_call))
    assert runs == []
    # The bridge giving up on a running call (its timeout) fails it even so: its late result is dropped.
    assert services.tool_calls_fail_queued([taken], error={"code": "tool_timeout", "message": "x"}, running=True) == [
        taken.call_id
    ]
    assert ToolCall.objects.get(call_id=taken.call_id).error["code"] == "tool_timeout"


def test_a_call_whose_tool_was_deleted_while_it_waited_fails_alone(runs: list) -> None:
    user = get_user_model().objects.create_user(username=f"gone-{uuid.uuid4().hex[:6]}")
    job = running_job(user=user)
    toolset = Toolset.objects.create(key=f"gone_{uuid.uuid4().hex[:6]}", name="Gone", kind="http", owner=user)
    gone_tool = Tool.objects.create(toolset=toolset, name="look", input_schema={"type": "object"})
    demo = Tool.objects.select_related("toolset").get(toolset__key="demo", toolset__owner=None, name="add")

    def checked(tool: Tool, arguments: dict[str, Any]) -> ToolCall:
        call_id = f"ptc_{uuid.uuid4().hex}"
        return services.tool_call_build(
            call_id=call_id, user=user, job=job, toolset=tool.toolset.key, tool=tool.name, arguments=arguments, found=tool
        )

    gone, add, later, never = (
        checked(gone_tool, {}),
        checked(demo, {"a": 1, "b": 2}),
        checked(gone_tool, {}),
        checked(gone_tool, {}),
    )
    toolset.delete()  # while its calls wait in the queue, their records (in their messages) naming it
    # Claimed in one statement with another toolset's call, as a worker's coinciding claims are.
    claimed = services._tool_calls_claim([(gone.call_id, gone), (add.call_id, add)])
    assert [call is not None and call.tool_id for call in claimed] == [None, demo.pk]
    # Its task records it failed, the tool no longer being there; the other call stays claimed.
    services.tool_call_execute(call_id=later.call_id, record=services.tool_call_signed(later))
    failed = ToolCall.objects.get(call_id=later.call_id)
    assert (failed.status, failed.error["code"], failed.tool_id) == ("failed", "unknown_tool", None)
    services.tool_call_execute(call_id=add.call_id, record=services.tool_call_signed(add))
    assert runs == [] and ToolCall.objects.get(call_id=add.call_id).status == "executing"  # claimed above: a duplicate
    # A job's end records its untaken calls as never run, the tool gone or not.
    assert services.tool_calls_fail_queued([never], error={"code": "job_ended", "message": "x"}, running=False) == [never.call_id]
    assert ToolCall.objects.get(call_id=never.call_id).tool_id is None
