"""The tools task under redelivery and cancel: a call runs at most once, and never for an ended job."""

import copy
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import OperationalError, connection, connections
from django.utils import timezone

from billing.models import Reservation
from execution.backplane import backplane, job_channel
from execution.models import ExecJob, ToolCall
from execution.services import calls as services
from execution.services.router import JobCallRouter
from tests.factories import demo_call, running_job
from tools.models import Tool, Toolset
from tools.selectors import toolsets_resolve


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


def _ends_logged(call: ToolCall) -> list[str]:
    """The ids of ``call``'s ends (tool_call_end, tool_call_error) in its job's event log."""
    logged = backplane().events_read(call.ptc_call_id)
    return [id_ for id_, name, data in logged if name in ("tool_call_end", "tool_call_error") and data["call_id"] == call.call_id]


def test_a_redelivery_that_finds_its_call_ended_logs_its_end_once(running_call: ToolCall, runs: list) -> None:
    # Ended and its end appended: a delivery again appends none. Ended, its end never appended (its
    # worker died between the finish's commit and the append; or the finish's reply was lost after
    # its commit, and its retry found it closed): the next delivery appends it, and one more none.
    services.tool_call_execute(call_id=running_call.call_id)
    (first,) = _ends_logged(running_call)
    services.tool_call_execute(call_id=running_call.call_id)
    assert _ends_logged(running_call) == [first]
    assert backplane().client.xdel(backplane().stream_key(running_call.ptc_call_id), first) == 1  # type: ignore[attr-defined]
    services.tool_call_execute(call_id=running_call.call_id)
    (again,) = _ends_logged(running_call)
    services.tool_call_execute(call_id=running_call.call_id)
    services.tool_call_execute(call_id=running_call.call_id)
    assert _ends_logged(running_call) == [again]
    assert len(runs) == 1
    # A log that has expired (its readers take the records) is not written again: none is made.
    backplane().events_drop([running_call.ptc_call_id])
    services.tool_call_execute(call_id=running_call.call_id)
    assert backplane().events_read(running_call.ptc_call_id) == []


def test_the_reaper_records_an_outcome_kept_by_a_tasks_last_retry_and_fails_one_not_made_here(running_call: ToolCall) -> None:
    # Two lapsed calls: one whose outcome its task's last retry kept (its tool ran), one with an
    # outcome kept that no worker of this deployment signed. The first is recorded with it, and
    # its outcome forgotten; the second fails worker_lost, as a call whose worker died.
    user = running_call.user
    forged = demo_call(user=user, job=running_call.exec_job)
    lapsed = timezone.now() - timedelta(seconds=settings.PTC_JOB_LEASE_SECONDS + 1)
    ToolCall.objects.filter(pk__in=[running_call.pk, forged.pk]).update(claimed_at=lapsed)
    outcome = services.OutcomeUnrecorded(call_id=running_call.call_id, reply={"ok": True, "result": 3}, billed=False).outcome
    assert services.tool_call_outcome_keep(call_id=running_call.call_id, outcome=outcome)
    assert backplane().outcome_keep(forged.call_id, outcome)  # another call's: its signature names that one
    try:
        services.tool_calls_reap()
        recorded, failed = ToolCall.objects.get(pk=running_call.pk), ToolCall.objects.get(pk=forged.pk)
        assert (recorded.status, recorded.output) == ("completed", 3)
        assert (failed.status, failed.error["code"]) == ("failed", "worker_lost")
        assert backplane().outcomes_kept([running_call.call_id, forged.call_id]) == {}
    finally:
        backplane().outcomes_drop([running_call.call_id, forged.call_id])


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


# -- A burst refused by the broker, its connection found dead ---------------------------------------
def test_calls_the_broker_refused_on_a_connection_found_dead_are_failed_under_the_ids_they_were_announced_with(
    monkeypatch: pytest.MonkeyPatch, django_db_setup: str
) -> None:
    # A free call of a job whose price is known needs no statement before it is queued: announced
    # (its start event out) and sent. With the broker down, the first statement is its failure's,
    # and the pooled connection it runs on may be found dead. It is written on a fresh one, under
    # the id the code and the event log know: not submitted again under a new id, which left the
    # first announced and never recorded (a message of it that reached the queue would then run).
    user = get_user_model().objects.create_user(username=f"refused-{uuid.uuid4().hex[:6]}")
    job = running_job(user=user)
    toolsets, _ = toolsets_resolve(user=user, keys=["demo"])
    router = JobCallRouter(job=job, toolsets=toolsets, direct_only=frozenset())
    announced: list[str] = []
    real_publish = services.events_publish_by_job

    def publish(events: list[tuple[str, tuple[str, dict[str, Any]]]]) -> None:
        announced.extend(data["call_id"] for _, (name, data) in events if name == "tool_call_start")
        real_publish(events)

    monkeypatch.setattr(services, "events_publish_by_job", publish)
    monkeypatch.setattr(services, "task_publish", lambda *args, **kwargs: None)
    warm = router.submit_many([("demo", "echo", {"value": "warm"})])  # prices Demo.echo for the job
    assert [type(outcome).__name__ for outcome in warm] == ["Dispatched"]
    announced.clear()
    killed: list[int] = []

    def refuse(*args: Any, **kwargs: Any) -> None:
        if not killed:  # the connection the failure will be written on dies first
            connection.ensure_connection()
            killed.append(connection.connection.info.backend_pid)
            with psycopg.connect(django_db_setup, autocommit=True) as admin:
                admin.execute("SELECT pg_terminate_backend(%s)", killed)
        raise ConnectionError("the broker is down")

    monkeypatch.setattr(services, "task_publish", refuse)
    outcomes = router.submit_many([("demo", "echo", {"value": "a"}), ("demo", "echo", {"value": "b"})])
    assert len(killed) == 1
    ids = [outcome.call_id for outcome in outcomes]
    assert [(type(o).__name__, o.error["code"]) for o in outcomes] == [("Refused", "broker_unavailable")] * 2  # type: ignore[union-attr]
    assert announced == ids
    recorded = ToolCall.objects.filter(exec_job=job).exclude(call_id=warm[0].call_id)
    assert sorted(recorded.values_list("call_id", "status")) == sorted((call_id, "failed") for call_id in ids)


@pytest.fixture
def row_locked_awhile(django_db_setup: str) -> Iterator[Callable[[str], None]]:
    """Lock a call's row (by call_id) as a transaction stuck elsewhere would, for 1.5 s, on a
    connection of its own; this process's statements wait on a lock 0.3 s at most meanwhile (its
    PTC_DB_STATEMENT_TIMEOUT is 30 s), so one that waits on it is cancelled."""
    holders: list[threading.Thread] = []

    def lock(call_id: str) -> None:
        locked = threading.Event()

        def hold() -> None:
            with psycopg.connect(django_db_setup) as holder:
                holder.execute("SELECT 1 FROM execution_toolcall WHERE call_id = %s FOR UPDATE", [call_id])
                locked.set()
                time.sleep(1.5)

        holders.append(threading.Thread(target=hold))
        holders[-1].start()
        assert locked.wait(10)
        with connection.cursor() as cursor:
            cursor.execute("SET lock_timeout = '300ms'")

    try:
        yield lock
    finally:
        for holder in holders:
            holder.join(10)
        connection.close()
        connection.close_pool()  # none of the pool's connections keeps the short lock_timeout


def _claimed_then_locked(call: ToolCall, monkeypatch: pytest.MonkeyPatch, row_locked_awhile: Callable[[str], None]) -> None:
    """Have ``call``'s tool deleted as it waited in the queue, and its row taken by a transaction
    stuck elsewhere (``row_locked_awhile``) as soon as this worker has claimed it."""
    call.tool = None
    real = services._claims

    def claimed_then_locked(item: Any) -> Any:
        claimed = real(item)
        row_locked_awhile(call.call_id)
        return claimed

    monkeypatch.setattr(services, "_claims", claimed_then_locked)


def test_a_claimed_calls_failure_whose_statement_is_cancelled_ends_it_with_its_own_code(
    queued_call: ToolCall, runs: list, monkeypatch: pytest.MonkeyPatch, row_locked_awhile: Callable[[str], None]
) -> None:
    """A tools worker claims a job's call whose tool was deleted since, and fails it unknown_tool;
    that statement waits on the call's row, held locked a while, and is cancelled. It is tried again
    until the lock goes, and the call ends unknown_tool, its price released, its code told so. Before,
    the cancel went up to the task, whose retry found the call claimed under a fresh lease and
    dropped it as a duplicate; a lease later the reaper failed it worker_lost."""
    _claimed_then_locked(queued_call, monkeypatch, row_locked_awhile)
    with backplane().subscribe(job_channel(queued_call.ptc_call_id)) as channel:
        services.tool_call_execute(call_id=queued_call.call_id, record=services.tool_call_signed(queued_call))
        channel.wait(5)
        replies = channel.drain()
    call = ToolCall.objects.get(call_id=queued_call.call_id)
    assert runs == []
    assert (call.status, call.error["code"]) == ("failed", "unknown_tool")
    assert [r.error["code"] for r in replies if r.call_id == call.call_id] == ["unknown_tool"]
    assert _held(call) == "released"


def test_a_claimed_calls_failure_the_database_did_not_take_within_the_retries_goes_with_its_tasks_retry(
    queued_call: ToolCall, runs: list, monkeypatch: pytest.MonkeyPatch, row_locked_awhile: Callable[[str], None]
) -> None:
    """A tools worker claims a job's call whose tool was deleted since, and fails it unknown_tool;
    that statement waits on the call's row, held locked past the worker's retries of it
    (PTC_DB_RETRY_SECONDS). The failure goes up with what the call came to, signed, and its task's
    retry records that once the lock goes: the call ends unknown_tool, its price released, its code
    told so; an outcome not signed by the deployment changes nothing. Before, the retry found the
    call claimed under a fresh lease and dropped it as a duplicate; a lease later the reaper failed
    it worker_lost."""
    _claimed_then_locked(queued_call, monkeypatch, row_locked_awhile)
    monkeypatch.setattr(settings, "PTC_DB_RETRY_SECONDS", 0.2)
    record = services.tool_call_signed(queued_call)
    with pytest.raises(services.OutcomeUnrecorded) as unrecorded:
        services.tool_call_execute(call_id=queued_call.call_id, record=record)
    replies = _retried_with(queued_call, unrecorded.value, monkeypatch, record=record)
    call = ToolCall.objects.get(call_id=queued_call.call_id)
    assert runs == []
    assert (call.status, call.error["code"]) == ("failed", "unknown_tool")
    assert [r.error["code"] for r in replies if r.call_id == call.call_id] == ["unknown_tool"]
    assert _held(call) == "released"


def _retried_with(
    call: ToolCall, unrecorded: services.OutcomeUnrecorded, monkeypatch: pytest.MonkeyPatch, record: str | None = None
) -> list[Any]:
    """Run ``call``'s task's retry as it comes with a forged outcome (asserting it changed nothing),
    then with the one ``unrecorded`` carries, its tries outlasting a lock (PTC_DB_RETRY_SECONDS);
    return what was pushed to the call's job meanwhile."""
    with backplane().subscribe(job_channel(call.ptc_call_id)) as channel:
        forged = '{"reply": {"ok": true, "result": 3}, "billed": true}:forged'  # completed, and charged
        services.tool_call_execute(call_id=call.call_id, record=record, alone=True, outcome=forged)
        assert ToolCall.objects.get(call_id=call.call_id).status == "executing"
        monkeypatch.setattr(settings, "PTC_DB_RETRY_SECONDS", 10.0)
        services.tool_call_execute(call_id=call.call_id, record=record, alone=True, outcome=unrecorded.outcome)
        channel.wait(5)
        return channel.drain()


def test_a_crashed_calls_failure_whose_statement_is_cancelled_ends_it_internal_error(
    running_call: ToolCall, row_locked_awhile: Callable[[str], None]
) -> None:
    """A tools worker's task crashed running a call it claimed (a bug), and it fails the call
    internal_error; that statement waits on the call's row, held locked a while, and is cancelled.
    It is tried again until the lock goes, and the call ends internal_error. Before, the cancel went
    up from the crash's handler and the call stayed executing, until the reaper failed it
    worker_lost, as if its worker had died."""
    assert services._claims((running_call.call_id, None)) is not None
    row_locked_awhile(running_call.call_id)
    with backplane().subscribe(job_channel(running_call.ptc_call_id)) as channel:
        services.tool_call_abort(call_id=running_call.call_id)
        channel.wait(5)
        replies = channel.drain()
    call = ToolCall.objects.get(call_id=running_call.call_id)
    assert (call.status, call.error["code"]) == ("failed", "internal_error")
    assert [r.error["code"] for r in replies if r.call_id == call.call_id] == ["internal_error"]


def test_a_crashed_calls_failure_the_database_did_not_take_within_the_retries_goes_with_its_tasks_retry(
    running_call: ToolCall, monkeypatch: pytest.MonkeyPatch, row_locked_awhile: Callable[[str], None]
) -> None:
    """A tools worker's task crashed running a call it claimed (a bug), and it fails the call
    internal_error; that statement waits on the call's row, held locked past the worker's retries of
    it. The failure goes up with what the call came to, and its task's retry records that once the
    lock goes: the call ends internal_error, its code told so. Before, the retry found the call
    claimed under a fresh lease and dropped it as a duplicate; a lease later the reaper failed it
    worker_lost."""
    assert services._claims((running_call.call_id, None)) is not None
    row_locked_awhile(running_call.call_id)
    monkeypatch.setattr(settings, "PTC_DB_RETRY_SECONDS", 0.2)
    with pytest.raises(services.OutcomeUnrecorded) as unrecorded:
        services.tool_call_abort(call_id=running_call.call_id)
    replies = _retried_with(running_call, unrecorded.value, monkeypatch)
    call = ToolCall.objects.get(call_id=running_call.call_id)
    assert (call.status, call.error["code"]) == ("failed", "internal_error")
    assert [r.error["code"] for r in replies if r.call_id == call.call_id] == ["internal_error"]


def test_an_outcome_carried_for_another_call_changes_nothing(running_call: ToolCall, runs: list) -> None:
    """A task's retry carries what its call came to, signed; put on another call's task (by whoever
    can write to the broker), it is not that call's: the call is left as it was, to run or to its
    lease, never ended with another call's result (another user's, perhaps) nor charged for it."""
    assert services._claims((running_call.call_id, None)) is not None
    other = services.OutcomeUnrecorded(call_id=f"ptc_{uuid.uuid4().hex}", reply={"ok": True, "result": "theirs"}, billed=True)
    services.tool_call_execute(call_id=running_call.call_id, alone=True, outcome=other.outcome)
    call = ToolCall.objects.get(call_id=running_call.call_id)
    assert (call.status, call.output) == ("executing", None)
    assert runs == []


def _claimed_unrun(call: ToolCall, monkeypatch: pytest.MonkeyPatch, record: str | None = None) -> str:
    """Have ``call``'s task claim it, then fail on the database as it looks its tool up (the tool
    not run); return the claim its retry carries (ClaimUnrun's)."""
    real = services.tool_for_call

    def away(**kwargs: Any) -> Any:
        raise OperationalError("server closed the connection unexpectedly")

    monkeypatch.setattr(services, "tool_for_call", away)
    with pytest.raises(services.ClaimUnrun) as unrun:
        services.tool_call_execute(call_id=call.call_id, record=record)
    monkeypatch.setattr(services, "tool_for_call", real)
    return unrun.value.claim


def _run_once_by_its_retry(call: ToolCall, record: str, claim: str, runs: list) -> None:
    """Run ``call``'s task's retry, which carries ``claim``: the call has run once (``runs``),
    completed with 3 and charged once, its result pushed to its code."""
    with backplane().subscribe(job_channel(call.ptc_call_id)) as channel:
        services.tool_call_execute(call_id=call.call_id, record=record, alone=True, claim=claim)
        channel.wait(5)
        replies = channel.drain()
    done = ToolCall.objects.get(call_id=call.call_id)
    assert len(runs) == 1
    assert (done.status, done.output, done.credits) == ("completed", 3, 1)
    assert [r.result for r in replies if r.call_id == done.call_id] == [3]
    assert _held(done) == "settled"


def test_a_claim_its_tasks_try_did_not_run_is_run_by_one_delivery_of_its_retry(
    queued_call: ToolCall, runs: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tools worker claims a job's call, then the database fails as it looks its tool up: its
    task's retry takes that claim over and runs the call, completed and charged once. Delivered
    twice, the retry runs it once (the other delivery, as the call runs, is dropped as a duplicate);
    a claim not this deployment's, or another call's, takes nothing over. Before, the retry found the
    call claimed under a fresh lease and dropped it; a lease later the reaper failed it worker_lost."""
    record = services.tool_call_signed(queued_call)
    claim = _claimed_unrun(queued_call, monkeypatch, record=record)
    assert runs == [] and ToolCall.objects.get(call_id=queued_call.call_id).status == "executing"
    # Another call's claim made at the same time, as a batch's claims are.
    other = services._CLAIM_SIGNER.sign(json.dumps(["ptc_other", json.loads(services._CLAIM_SIGNER.unsign(claim))[1]]))
    for forged in (claim[:-2] + "xx", other):
        services.tool_call_execute(call_id=queued_call.call_id, record=record, alone=True, claim=forged)
    assert runs == [] and ToolCall.objects.get(call_id=queued_call.call_id).status == "executing"
    counting, again = services.tool_run, []

    def run_delivered_again(**kwargs: Any) -> Any:
        if not again:  # the retry's other delivery comes as the call runs
            again.append(True)
            services.tool_call_execute(call_id=queued_call.call_id, record=record, alone=True, claim=claim)
        return counting(**kwargs)

    monkeypatch.setattr(services, "tool_run", run_delivered_again)
    _run_once_by_its_retry(queued_call, record, claim, runs)


def test_a_claim_its_tasks_try_did_not_run_fails_job_ended_if_its_job_ended_before_the_retry(
    running_call: ToolCall, runs: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tools worker claims a call, the database fails as it looks its tool up, and the call's job
    ends before the task's retry: the retry fails the call job_ended, not run, its code told so.
    Without it, the call stayed claimed until the reaper failed it worker_lost a lease later."""
    claim = _claimed_unrun(running_call, monkeypatch)
    ExecJob.objects.filter(pk=running_call.exec_job_id).update(status="cancelled")
    with backplane().subscribe(job_channel(running_call.ptc_call_id)) as channel:
        services.tool_call_execute(call_id=running_call.call_id, alone=True, claim=claim)
        channel.wait(5)
        replies = channel.drain()
    call = ToolCall.objects.get(call_id=running_call.call_id)
    assert runs == []
    assert (call.status, call.error["code"]) == ("failed", "job_ended")
    assert [r.error["code"] for r in replies if r.call_id == call.call_id] == ["job_ended"]


def _claim_unanswered(monkeypatch: pytest.MonkeyPatch, committed: bool) -> None:
    """Have the next claim of a job's call fail as a dropped connection does: after its statement
    committed (``committed``: its reply lost), or before."""
    real = services._tool_calls_record_claimed

    def dropped(calls: list[ToolCall], **kwargs: Any) -> Any:
        monkeypatch.setattr(services, "_tool_calls_record_claimed", real)
        if committed:
            real(calls, **kwargs)
        raise OperationalError("server closed the connection unexpectedly")

    monkeypatch.setattr(services, "_tool_calls_record_claimed", dropped)


def test_a_claim_whose_reply_was_lost_is_run_by_its_tasks_retry_and_by_no_other_delivery(
    queued_call: ToolCall, runs: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tools worker's claim of a job's call commits and its reply is lost (the connection dropped):
    its task's retry carries the claim its try may have made, takes it over and runs the call once,
    charged once. A delivery of the call's task that is not that retry (the broker's redelivery, to
    another worker) finds it claimed and drops it. Before, the retry found the call claimed under a
    fresh lease and dropped it as a duplicate; a lease later the reaper failed it worker_lost."""
    record = services.tool_call_signed(queued_call)
    _claim_unanswered(monkeypatch, committed=True)
    with pytest.raises(services.ClaimUnrun) as unrun:
        services.tool_call_execute(call_id=queued_call.call_id, record=record)
    assert ToolCall.objects.get(call_id=queued_call.call_id).claimed_at is not None
    for alone in (False, True):
        services.tool_call_execute(call_id=queued_call.call_id, record=record, alone=alone)
    assert runs == [] and ToolCall.objects.get(call_id=queued_call.call_id).status == "executing"
    _run_once_by_its_retry(queued_call, record, unrun.value.claim, runs)


@pytest.mark.parametrize("another_worker", [False, True])
def test_a_claim_that_failed_uncommitted_is_made_by_its_tasks_retry_unless_another_worker_claimed_the_call(
    queued_call: ToolCall, runs: list, monkeypatch: pytest.MonkeyPatch, another_worker: bool
) -> None:
    """A tools worker's claim of a job's call fails on a dropped connection before it committed: its
    task's retry claims the call and runs it once. If another worker claimed it meanwhile (a
    redelivery of its task), the retry takes nothing over and runs nothing: the call is that
    worker's, its claim untouched."""
    record = services.tool_call_signed(queued_call)
    _claim_unanswered(monkeypatch, committed=False)
    with pytest.raises(services.ClaimUnrun) as unrun:
        services.tool_call_execute(call_id=queued_call.call_id, record=record)
    assert not ToolCall.objects.filter(call_id=queued_call.call_id).exists()
    if another_worker:
        other = services._tool_calls_claim([(queued_call.call_id, services._tool_call_unsigned(record))])[0]
        assert other is not None
    services.tool_call_execute(call_id=queued_call.call_id, record=record, alone=True, claim=unrun.value.claim)
    call = ToolCall.objects.get(call_id=queued_call.call_id)
    if another_worker:
        assert runs == []
        assert (call.status, call.claimed_at) == ("executing", other.claimed_at)
    else:
        assert len(runs) == 1
        assert (call.status, call.output, call.credits) == ("completed", 3, 1)


def test_a_connection_that_fails_to_go_back_to_the_pool_as_the_tool_starts_does_not_stop_the_call(
    running_call: ToolCall, runs: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tools worker hands its connection back to the pool as a call's tool starts (the tool needs
    none); should that fail on the database, the tool runs all the same, once, and the call completes.
    Before, the error went up to the task bare: the call stayed claimed and unrun, its task's retry
    dropped it as a duplicate, and a lease later the reaper failed it worker_lost."""
    wrapper = type(connections["default"])
    real, failed = wrapper.close, []

    def close_failing_once(self: Any) -> None:
        real(self)
        if not failed:
            failed.append(True)
            raise OperationalError("server closed the connection unexpectedly")

    monkeypatch.setattr(wrapper, "close", close_failing_once)
    services.tool_call_execute(call_id=running_call.call_id)
    call = ToolCall.objects.get(call_id=running_call.call_id)
    assert failed, "the tools worker never handed its connection back"
    assert len(runs) == 1
    assert (call.status, call.output) == ("completed", 3)
