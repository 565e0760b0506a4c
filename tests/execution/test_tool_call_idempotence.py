"""The tools task under redelivery and cancel: a call runs at most once, and never for an ended job."""

import uuid
from datetime import timedelta
from typing import Any

import pytest
from django.conf import settings
from django.contrib.auth import get_user_model
from django.utils import timezone

from execution.backplane import backplane, job_channel
from execution.models import ExecJob, ToolCall
from execution.services import calls as services
from tests.factories import demo_call, running_job


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
