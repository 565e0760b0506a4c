"""Hostile tests of the books against real workers and PostgreSQL: whatever runs at once, fails or is
cancelled while billed calls are in flight, every hold ends settled or released, nothing is charged
twice or past a budget, and the ledger stays exact."""

import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.db import transaction
from django.utils import timezone

from billing.models import CreditAccount, CreditUsage, LedgerEntry, Reservation
from billing.selectors import ledger_mismatches
from billing.services import credits_reserve, price_quote
from execution.models import ToolCall
from execution.services.jobs import exec_job_for_container
from tests.conftest import Api, own_deployment
from tests.factories import demo_call
from tests.servers import api_key
from tests.stack import ROOT, Stack

FAN_OUT = """
from concurrent.futures import ThreadPoolExecutor
from ptc_tools import ToolError
from ptc_tools.demo import Demo
def call(i):
    try:
        Demo.sleep(ms=300)
        return "ok"
    except ToolError as e:
        return e.code
with ThreadPoolExecutor(16) as pool:
    outcomes = list(pool.map(call, range(24)))
sorted(outcomes)
"""


def _until(check: Callable[[], bool], seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, f"not within {seconds} s: {what}"
        time.sleep(0.1)


def test_jobs_racing_for_the_last_credits_under_budgets_and_a_cancel_keep_the_books_exact(
    make_api: Callable[..., Api],
) -> None:
    """Four jobs of one user fan out 24 priced calls each, 16 at a time, with a budget of 10 each,
    for 30 credits in all; one is cancelled while its calls run. No job spends past its budget, the
    user never past the balance, each completed call is charged once and the others not at all,
    and every hold ends."""
    api = make_api(credits=30)
    account = CreditAccount.objects.get(user__username=api.username)

    def submit(_: int) -> str:
        response = api.post("/api/v1/exec", json={"code": FAN_OUT, "toolsets": ["demo"], "wait": 0, "max_credits": 10})
        assert response.status_code == 201, response.text
        return response.json()["id"]

    with ThreadPoolExecutor(4) as pool:
        jobs = list(pool.map(submit, range(4)))
    victim = jobs[0]
    _until(lambda: Reservation.objects.filter(exec_job_id=victim).exists(), 30, "the first job's calls are held")
    cancelled = api.post(f"/api/v1/exec/{victim}/cancel")
    assert cancelled.status_code in (200, 202, 409), cancelled.text

    ended = {}
    for job_id in jobs:
        deadline = time.monotonic() + 60
        while True:
            job = api.get(f"/api/v1/exec/{job_id}").json()
            if job["status"] not in ("queued", "running"):
                ended[job_id] = job
                break
            assert time.monotonic() < deadline, f"job {job_id} did not end"
            time.sleep(0.2)

    # Every hold ends: the reaper closes any a call left open.
    _until(
        lambda: not Reservation.objects.filter(account=account, status=Reservation.Status.HELD).exists(),
        30,
        "every hold is settled or released",
    )
    account.refresh_from_db()
    assert account.reserved == 0
    assert account.balance >= 0, "the user spent more than they had"
    charged = {job_id: ToolCall.objects.filter(exec_job_id=job_id, status="completed").count() for job_id in jobs}
    for job_id in ended:
        # Read again: a call a tools worker had taken when its job was cancelled runs to its end.
        job = api.get(f"/api/v1/exec/{job_id}").json()
        assert charged[job_id] <= 10, f"job {job_id} spent past its budget: {charged[job_id]}"
        assert job["credits_charged"] == charged[job_id], job_id
    assert 30 - account.balance == sum(charged.values())
    usage = CreditUsage.objects.filter(user__username=api.username)
    assert usage.count() == sum(charged.values())
    assert LedgerEntry.objects.filter(account=account, kind="charge").count() == sum(charged.values())
    # A call refused is failed with its code; one that ran and completed is charged.
    for call in ToolCall.objects.filter(exec_job_id__in=jobs, status="failed"):
        assert call.credits == 0
        assert call.error and call.error.get("code"), call.error
    assert ledger_mismatches() == []
    call_command("check_ledger")


def test_standalone_calls_racing_for_the_last_credits_never_overdraw(make_api: Callable[..., Api]) -> None:
    """20 POST /tools/execute at once for 5 credits: 5 run and are charged, 15 are refused before
    they run with insufficient_credits, each refusal a complete record with a readable message."""
    api = make_api(credits=5)

    def call(i: int) -> dict:
        response = api.post("/api/v1/tools/execute", json={"toolset": "demo", "tool": "add", "arguments": {"a": i, "b": 1}})
        assert response.status_code == 200, response.text
        return response.json()

    with ThreadPoolExecutor(20) as pool:
        records = list(pool.map(call, range(20)))
    completed = [r for r in records if r["status"] == "completed"]
    refused = [r for r in records if r["status"] == "failed"]
    assert (len(completed), len(refused)) == (5, 15)
    assert all(r["credits"] == 1 for r in completed)
    for record in refused:
        assert record["error"]["code"] == "insufficient_credits"
        assert "credits" in record["error"]["message"] and "available" in record["error"]["message"]
        assert record["credits"] == 0 and record["finished_at"] and record["input"] == {"a": record["input"]["a"], "b": 1}
    account = CreditAccount.objects.get(user__username=api.username)
    assert (account.balance, account.reserved) == (0, 0)
    assert LedgerEntry.objects.filter(account=account, kind="charge").count() == 5
    assert ledger_mismatches() == []


def test_a_managed_containers_call_its_web_process_never_queued_gives_back_its_hold(api: Api) -> None:
    """A managed container's call over POST /tools/execute is recorded, its price held, then queued
    by the web process that took it. Killed in between, it leaves the call executing and unclaimed,
    its price held. Its job, the container's, runs until someone cancels it (days): the reaper, which
    fails such a call of a job that has ended, or of no job, once no worker took it in twice the
    tools' timeout, left this one and its hold for the job's life."""
    user = get_user_model().objects.get(username=api.username)
    with transaction.atomic():  # as the call that makes it: its row is locked until the call is recorded
        job = exec_job_for_container(user=user, container_id=f"cntr_{uuid.uuid4().hex[:12]}")
    long_ago = timezone.now() - timedelta(hours=1)
    call = demo_call(user=user, job=job, started_at=long_ago)
    credits_reserve(
        user=user, holds=[(call.call_id, price_quote(user=user, toolset=call.tool.toolset, tool=call.tool))], exec_job=job
    )
    Reservation.objects.filter(tool_call_id=call.call_id).update(created_at=long_ago)
    account = CreditAccount.objects.get(user=user)
    assert account.reserved == 1
    # What the web process would have done next never happens. The exec workers' reaper runs
    # every second here.
    _until(
        lambda: Reservation.objects.get(tool_call_id=call.call_id).status != Reservation.Status.HELD,
        20,
        "the hold of a call no worker will ever take is given back",
    )
    assert Reservation.objects.get(tool_call_id=call.call_id).status == Reservation.Status.RELEASED
    recorded = ToolCall.objects.get(call_id=call.call_id)
    assert recorded.status == "failed" and recorded.error["code"] == "worker_lost"
    account.refresh_from_db()
    assert (account.balance, account.reserved) == (10_000, 0)
    job.refresh_from_db()
    assert job.status == "running", "the container's job goes on: only the lost call ended"


THREE_ADDS = """
from ptc_tools import ToolError
from ptc_tools.demo import Demo
for i in range(3):
    try:
        Demo.add(a=i, b=0)
    except ToolError as e:
        print(e.code, "|", e.message)
"""


def test_a_refusal_for_credits_says_what_happened_and_what_to_do(make_api: Callable[..., Api]) -> None:
    """Errors are for people (STYLE 15): the code reads ``insufficient_credits`` or
    ``budget_exceeded``; a person reads the message, in English, and what would let the call run."""
    api = make_api(credits=1)
    job = api.run(
        THREE_ADDS,
        toolsets=["demo"],
        max_credits=2,
    )
    assert job["status"] == "completed", job["error"]
    assert job["stdout"].splitlines() == [
        "insufficient_credits | this call costs 1 credit and 0 are available: "
        "ask an operator for credits (POST /api/v1/billing/credits), then call again",
        "insufficient_credits | this call costs 1 credit and 0 are available: "
        "ask an operator for credits (POST /api/v1/billing/credits), then call again",
    ]
    api = make_api(credits=10)
    job = api.run(
        THREE_ADDS,
        toolsets=["demo"],
        max_credits=2,
    )
    assert job["stdout"] == (
        "budget_exceeded | this call costs 1 credit and the job has 0 of its 2-credit budget (max_credits) left: "
        "no more priced calls can run in this job\n"
    )
    refused = job["tool_calls"][-1]
    assert (refused["status"], refused["credits"], refused["error"]["code"]) == ("failed", 0, "budget_exceeded")


@pytest.fixture(scope="module")
def killable(stack_env: dict[str, str]) -> Iterator[Stack]:
    """A deployment of its own (its database, its queues, no beat), whose workers a test may kill."""
    with own_deployment(stack_env, "ledger-kill") as stack:
        yield stack


def test_a_tools_worker_killed_with_billed_calls_in_flight_charges_none_of_them_and_holds_nothing(killable: Stack) -> None:
    """SIGKILL of the tools worker between the holds of 16 calls and their settles: the calls end
    worker_lost, nothing is charged for them, every hold goes back, and check_ledger finds the
    books exact; the restarted worker's calls are charged as usual."""
    username = f"kill-{uuid.uuid4().hex[:8]}"
    api = Api(killable.base_url, api_key(killable.env, username, credits=100), username)
    code = FAN_OUT.replace("Demo.sleep(ms=300)", "Demo.sleep(ms=8000)").replace("range(24)", "range(16)")
    job = api.post("/api/v1/exec", json={"code": code, "toolsets": ["demo"], "wait": 0, "timeout": 60}).json()
    deadline = time.monotonic() + 20
    while api.get("/api/v1/billing/balance").json()["reserved"] < 16:
        assert time.monotonic() < deadline, "the 16 calls were never held"
        time.sleep(0.1)
    time.sleep(1)  # taken by the tools worker within milliseconds
    killable.tools_worker.kill()
    try:
        deadline = time.monotonic() + 40
        while (final := api.get(f"/api/v1/exec/{job['id']}").json())["status"] in ("queued", "running"):
            assert time.monotonic() < deadline, "the job did not end"
            time.sleep(0.2)
    finally:
        killable.tools_worker.start()
    assert final["status"] == "completed", final["error"]
    assert final["return_value"].count("worker_lost") == 16, final["return_value"]
    _until(lambda: api.get("/api/v1/billing/balance").json()["reserved"] == 0, 20, "every hold goes back")
    assert api.get("/api/v1/billing/balance").json()["balance"] == 100
    again = api.post("/api/v1/exec", json={"code": FAN_OUT.replace("range(24)", "range(5)"), "toolsets": ["demo"], "wait": 60})
    assert again.json()["credits_charged"] == 5, again.json()
    assert api.get("/api/v1/billing/balance").json() | {"plan": None, "plan_expires_at": None} == {
        "balance": 95,
        "reserved": 0,
        "plan": None,
        "plan_expires_at": None,
    }
    checked = subprocess.run(
        [sys.executable, "manage.py", "check_ledger"], cwd=ROOT, env=killable.env, capture_output=True, text=True
    )
    assert checked.returncode == 0 and "Every balance equals the sum of its ledger." in checked.stdout, checked.stderr


def test_a_call_that_costs_nothing_is_never_refused_for_credits() -> None:
    # Staff may take a balance below what its running calls hold (an adjustment is theirs to make;
    # the held calls still settle). A call free by a 100% discount was then refused
    # insufficient_credits, "this call costs 0 credits and 0 are available".
    from billing.services import Quote, credits_adjust

    user = get_user_model().objects.create_user(username=f"zero-{uuid.uuid4().hex[:8]}")
    credits_adjust(user=user, amount=5, reason="grant")
    priced = demo_call(user=user)
    assert (
        credits_reserve(
            user=user, holds=[(priced.call_id, price_quote(user=user, toolset=priced.tool.toolset, tool=priced.tool))]
        )
        == {}
    )
    credits_adjust(user=user, amount=-5, reason="taken back", created_by=user)  # 0 left, 1 held
    account = CreditAccount.objects.get(user=user)
    free = demo_call(user=user)
    quote = Quote(amount=0, due_amount=1, meta={"discount": "100%"}, account_id=account.pk)
    assert credits_reserve(user=user, holds=[(free.call_id, quote)]) == {}
    assert Reservation.objects.get(tool_call_id=free.call_id).amount == 0
    assert CreditAccount.objects.get(user=user).reserved == 1
