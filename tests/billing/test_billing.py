"""Billing against real workers and PostgreSQL: every call that should cost credits costs exactly once."""

import io
import re
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import httpx
import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.db.models import F
from django.db.models.signals import pre_save
from django.test import Client
from django.utils import timezone

from billing.ledger import Ledger, OrmLedger, PostgresLedger
from billing.models import CreditAccount, CreditUsage, Discount, LedgerEntry, Plan, Reservation
from billing.selectors import ledger_mismatches
from billing.services import account_get, credits_release, credits_reserve, price_quote
from execution.models import ToolCall
from execution.services import calls as execution_services
from tests.conftest import Api
from tests.factories import demo_call, running_job
from tools.models import Tool, Toolset


def balance(api: Api) -> int:
    return api.get("/api/v1/billing/balance").json()["balance"]


def test_a_successful_call_is_charged_once_and_a_failed_one_not_at_all(make_api: Callable[..., Api]) -> None:
    api = make_api(credits=10)
    job = api.run(
        "from ptc_tools import ToolError\nfrom ptc_tools.demo import Demo\n"
        "Demo.add(a=1, b=2)\nDemo.echo(value=1)\ntry:\n    Demo.fail(message='x')\nexcept ToolError:\n    pass",
        toolsets=["demo"],
    )
    assert job["status"] == "completed", job["error"]
    assert job["credits_charged"] == 1
    assert [(c["tool"], c["credits"]) for c in job["tool_calls"]] == [("add", 1), ("echo", 0), ("fail", 0)]
    assert balance(api) == 9
    usage = api.get("/api/v1/billing/usage", params={"exec": job["id"]}).json()
    assert usage["count"] == 1  # echo is free: no row; fail did not succeed: no row
    [row] = usage["results"]
    assert row["tool_call_meta"] == {"toolName": "add", "toolsetKey": "demo"}
    assert (row["amount"], row["due_amount"], row["usage_type"]) == (1, 1, "tool_call")
    assert row["tool_call_id"] == job["tool_calls"][0]["call_id"]
    assert row["exec_id"] == job["id"]


def test_parallel_calls_can_never_overdraw(make_api: Callable[..., Api]) -> None:
    api = make_api(credits=5)
    code = """
from concurrent.futures import ThreadPoolExecutor
from ptc_tools import ToolError
from ptc_tools.demo import Demo
def call(i):
    try:
        Demo.add(a=i, b=0)
        return "ok"
    except ToolError as e:
        return e.code
with ThreadPoolExecutor(20) as pool:
    outcomes = list(pool.map(call, range(20)))
sorted(outcomes)
"""
    job = api.run(code, toolsets=["demo"])
    assert job["status"] == "completed", job["error"]
    assert job["return_value"].count("ok") == 5
    assert job["return_value"].count("insufficient_credits") == 15
    assert balance(api) == 0
    refused = [c for c in job["tool_calls"] if c["status"] == "failed"]
    assert len(refused) == 15
    assert all(c["error"]["code"] == "insufficient_credits" for c in refused)
    account = CreditAccount.objects.get(user__username=api.username)
    assert (account.balance, account.reserved) == (0, 0)


def test_calls_that_finish_together_are_recorded_charged_and_streamed_each_once(make_api: Callable[..., Api]) -> None:
    """A fan-out's calls end at the same moment, so the tools worker records them in batches (one
    UPDATE, its settles, one pipeline of results then events): each is still charged exactly once,
    each failure releases its hold, and each call's events come start first."""
    from tests.execution.test_events import read_events

    api = make_api(credits=1000)
    code = """
from concurrent.futures import ThreadPoolExecutor
from ptc_tools import ToolError
from ptc_tools.demo import Demo
def call(i):
    try:
        return Demo.sleep(ms=300)["slept_ms"] if i % 5 else Demo.fail(message=f"no {i}")
    except ToolError as e:
        return e.code
with ThreadPoolExecutor(40) as pool:
    outcomes = list(pool.map(call, range(40)))
sorted(map(str, outcomes))
"""
    job = api.run(code, toolsets=["demo"])
    assert job["status"] == "completed", job["error"]
    assert job["return_value"].count("300") == 32 and job["return_value"].count("tool_failed") == 8
    completed = [c for c in job["tool_calls"] if c["status"] == "completed"]
    assert len(completed) == 32 and all(c["credits"] == 1 for c in completed)
    assert balance(api) == 1000 - 32
    account = CreditAccount.objects.get(user__username=api.username)
    assert (account.balance, account.reserved) == (968, 0), "every failed call's hold went back"
    assert CreditUsage.objects.filter(user__username=api.username).count() == 32
    # Calls recorded by one statement share its finish time: the batches really formed.
    assert len({c["finished_at"] for c in completed}) < len(completed)
    events, _ = read_events(api, job["id"])
    for call in job["tool_calls"]:
        mine = [e["event"] for e in events if e["event"].startswith("tool_call") and e["data"]["call_id"] == call["call_id"]]
        assert mine == ["tool_call_start", "tool_call_end" if call["status"] == "completed" else "tool_call_error"]
    assert ledger_mismatches() == []


def test_the_job_budget_stops_calls_and_the_code_can_finish(api: Api) -> None:
    code = """
from ptc_tools import ToolError
from ptc_tools.demo import Demo
done = []
for i in range(5):
    try:
        done.append(Demo.add(a=i, b=0))
    except ToolError as e:
        print(e.code)
        break
done
"""
    job = api.run(code, toolsets=["demo"], max_credits=3)
    assert job["status"] == "completed", job["error"]
    assert job["return_value"] == [0, 1, 2]
    assert job["stdout"] == "budget_exceeded\n"
    assert job["credits_charged"] == 3
    assert job["max_credits"] == 3


def test_a_burst_is_held_in_one_go_or_call_by_call_as_far_as_the_credits_go(make_api: Callable[..., Api]) -> None:
    api = make_api(credits=5)
    user = get_user_model().objects.get(username=api.username)
    tool = Tool.objects.select_related("toolset").get(toolset__key="demo", toolset__owner=None, name="add")
    quote = price_quote(user=user, toolset=tool.toolset, tool=tool)
    assert quote is not None and quote.amount == 1
    first = [(f"burst_{uuid.uuid4().hex}", quote) for _ in range(3)]
    assert credits_reserve(user=user, holds=first) == {}
    rest = [(f"burst_{uuid.uuid4().hex}", quote) for _ in range(4)]
    refused = credits_reserve(user=user, holds=rest)
    # The burst's total is not there: each is held in order while the credits last.
    assert list(refused) == [rest[2][0], rest[3][0]]
    assert {exc.code for exc in refused.values()} == {"insufficient_credits"}
    account = CreditAccount.objects.get(user=user)
    assert (account.balance, account.reserved) == (5, 5)
    held = [call_id for call_id, _ in first + rest[:2]]
    assert sorted(Reservation.objects.filter(status="held", account=account).values_list("tool_call_id", flat=True)) == sorted(
        held
    )
    # A job's budget holds a burst the same way.
    job = running_job(user=user)
    for call_id in held:
        credits_release(tool_call_id=call_id)
    budgeted = [(f"burst_{uuid.uuid4().hex}", quote) for _ in range(3)]
    refused = credits_reserve(user=user, holds=budgeted, exec_job=job, max_credits=2)
    assert list(refused) == [budgeted[2][0]] and refused[budgeted[2][0]].code == "budget_exceeded"
    for call_id, _ in budgeted[:2]:
        credits_release(tool_call_id=call_id)
    account.refresh_from_db()
    assert (account.balance, account.reserved) == (5, 0)


@pytest.mark.parametrize("backend", [PostgresLedger, OrmLedger])
def test_a_batch_of_one_users_calls_is_settled_each_once(make_api: Callable[..., Api], backend: type[Ledger]) -> None:
    api = make_api(credits=10)
    user = get_user_model().objects.get(username=api.username)
    tool = Tool.objects.select_related("toolset").get(toolset__key="demo", toolset__owner=None, name="add")
    quote = price_quote(user=user, toolset=tool.toolset, tool=tool)
    assert quote is not None and quote.amount == 1
    calls = [f"batch_{uuid.uuid4().hex}" for _ in range(3)]
    assert credits_reserve(user=user, holds=[(call_id, quote) for call_id in calls]) == {}
    ledger = backend()
    # Two of the three, and one that holds nothing: each held one is charged, once.
    assert ledger.settle_many(tool_call_ids=[*calls[:2], "batch_never_held"]) == {calls[0]: 1, calls[1]: 1}
    assert ledger.settle_many(tool_call_ids=calls) == {calls[2]: 1}
    account = CreditAccount.objects.get(user=user)
    assert (account.balance, account.reserved) == (7, 0)
    assert sorted(CreditUsage.objects.filter(user=user).values_list("tool_call_id", flat=True)) == sorted(calls)
    assert LedgerEntry.objects.filter(account=account, kind="charge", tool_call_id__in=calls).count() == 3
    assert ledger_mismatches() == []


@pytest.mark.parametrize("backend", [PostgresLedger, OrmLedger])
def test_a_batch_of_one_users_completed_and_failed_calls_is_settled_and_released_each_once(
    make_api: Callable[..., Api], backend: type[Ledger]
) -> None:
    # On PostgreSQL one statement, which updates the account's row once for both (a row updated twice
    # in one statement is updated once).
    api = make_api(credits=10)
    user = get_user_model().objects.get(username=api.username)
    tool = Tool.objects.select_related("toolset").get(toolset__key="demo", toolset__owner=None, name="add")
    quote = price_quote(user=user, toolset=tool.toolset, tool=tool)
    assert quote is not None and quote.amount == 1
    calls = [f"batch_{uuid.uuid4().hex}" for _ in range(4)]
    assert credits_reserve(user=user, holds=[(call_id, quote) for call_id in calls]) == {}
    ledger = backend()
    assert ledger.close_many(settle=calls[:2], release=[calls[2]]) == {calls[0]: 1, calls[1]: 1}
    account = CreditAccount.objects.get(user=user)
    assert (account.balance, account.reserved) == (8, 1)
    # Again, and the last one released: each held one is closed once.
    assert ledger.close_many(settle=calls[:1], release=calls[2:]) == {}
    account.refresh_from_db()
    assert (account.balance, account.reserved) == (8, 0)
    statuses = dict(Reservation.objects.filter(tool_call_id__in=calls).values_list("tool_call_id", "status"))
    assert [statuses[call_id] for call_id in calls] == ["settled", "settled", "released", "released"]
    assert LedgerEntry.objects.filter(account=account, kind="charge", tool_call_id__in=calls).count() == 2
    assert ledger_mismatches() == []


def test_a_tools_workers_batch_of_one_users_calls_charges_those_that_completed_and_gives_back_the_rest(api: Api) -> None:
    # One statement records the calls, settles the completed ones and releases the failed ones.
    user = get_user_model().objects.get(username=api.username)
    tool = Tool.objects.select_related("toolset").get(toolset__key="demo", toolset__owner=None, name="add")
    job = running_job(user=user)
    calls = [demo_call(user=user, job=job) for _ in range(4)]
    quote = price_quote(user=user, toolset=tool.toolset, tool=tool)
    assert credits_reserve(user=user, holds=[(call.call_id, quote) for call in calls], exec_job=job) == {}
    before = CreditAccount.objects.get(user=user)
    replies = [{"ok": True, "result": 3}] * 2 + [{"ok": False, "error": {"code": "tool_failed", "message": "no"}}] * 2
    batch = [execution_services._Ran(call=call, reply=reply, billed=True) for call, reply in zip(calls, replies, strict=True)]
    assert execution_services._tool_calls_finish_ran(batch, brief=True) == [True] * 4
    after = CreditAccount.objects.get(user=user)
    assert (after.balance, after.reserved) == (before.balance - 2, before.reserved - 4)
    records = {r.call_id: r for r in ToolCall.objects.filter(call_id__in=[call.call_id for call in calls])}
    assert [(records[c.call_id].status, records[c.call_id].credits) for c in calls] == [("completed", 1)] * 2 + [
        ("failed", 0)
    ] * 2
    statuses = dict(Reservation.objects.filter(tool_call_id__in=records).values_list("tool_call_id", "status"))
    assert [statuses[call.call_id] for call in calls] == ["settled"] * 2 + ["released"] * 2
    assert ledger_mismatches() == []


def test_a_plan_with_free_tools_records_the_price_and_charges_nothing(api: Api) -> None:
    account = account_get(user=get_user_model().objects.get(username=api.username))
    account.plan = Plan.objects.get(key="plus")
    account.plan_expires_at = timezone.now() + timedelta(days=30)
    account.save()
    before = balance(api)
    job = api.run("from ptc_tools.demo import Demo\nDemo.add(a=1, b=1)", toolsets=["demo"])
    assert job["credits_charged"] == 0
    assert balance(api) == before
    [row] = api.get("/api/v1/billing/usage", params={"exec": job["id"]}).json()["results"]
    assert (row["amount"], row["due_amount"]) == (0, 1)
    body = api.get("/api/v1/billing/balance").json()
    assert body["plan"] == "plus"
    assert body["plan_expires_at"] is not None
    account.plan_expires_at = timezone.now() - timedelta(seconds=1)  # the plan ran out: billed again
    account.save()
    assert api.run("from ptc_tools.demo import Demo\nDemo.add(a=1, b=1)", toolsets=["demo"])["credits_charged"] == 1


def test_free_tool_access_ends_at_its_date_in_the_middle_of_a_job(api: Api) -> None:
    # A job prices each tool once for its life, but not past the end of the plan that priced it.
    account = account_get(user=get_user_model().objects.get(username=api.username))
    account.plan = Plan.objects.get(key="plus")
    account.plan_expires_at = timezone.now() + timedelta(seconds=6)  # room for the first call on a busy machine
    account.save()
    code = (
        "import time\nfrom ptc_tools.demo import Demo\nDemo.add(a=1, b=1)\n"
        f"while time.time() < {account.plan_expires_at.timestamp() + 0.5}:\n    time.sleep(0.1)\nDemo.add(a=2, b=2)"
    )
    job = api.run(code, toolsets=["demo"])
    assert job["status"] == "completed", job["error"]
    assert [c["credits"] for c in job["tool_calls"]] == [0, 1]
    assert job["credits_charged"] == 1


def test_a_redelivered_tools_task_charges_once(api: Api) -> None:
    user = get_user_model().objects.get(username=api.username)
    job = running_job(user=user)
    call = demo_call(user=user, job=job, input={"a": 1, "b": 1})
    tool = call.tool
    credits_reserve(user=user, holds=[(call.call_id, price_quote(user=user, toolset=tool.toolset, tool=tool))], exec_job=job)
    before = CreditAccount.objects.get(user=user).balance
    execution_services.tool_call_execute(call_id=call.call_id)
    execution_services.tool_call_execute(call_id=call.call_id)  # the broker delivers it again
    assert CreditAccount.objects.get(user=user).balance == before - 1
    assert CreditUsage.objects.filter(tool_call_id=call.call_id).count() == 1
    assert LedgerEntry.objects.filter(tool_call_id=call.call_id, kind="charge").count() == 1
    assert ToolCall.objects.get(pk=call.pk).credits == 1


def test_the_reaper_settles_or_releases_what_a_dead_worker_left_held(api: Api) -> None:
    user = get_user_model().objects.get(username=api.username)
    tool = Tool.objects.select_related("toolset").get(toolset__key="demo", toolset__owner=None, name="add")
    quote = price_quote(user=user, toolset=tool.toolset, tool=tool)
    made = {}
    for outcome in ("completed", "failed"):
        call = demo_call(user=user, status=outcome, output=2 if outcome == "completed" else None)
        credits_reserve(user=user, holds=[(call.call_id, quote)])
        made[outcome] = call.call_id
    Reservation.objects.filter(tool_call_id__in=made.values()).update(created_at=timezone.now() - timedelta(minutes=5))
    before = CreditAccount.objects.get(user=user)
    execution_services.tool_calls_close_held()
    after = CreditAccount.objects.get(user=user)
    assert after.balance == before.balance - 1
    assert after.reserved == before.reserved - 2
    assert Reservation.objects.get(tool_call_id=made["completed"]).status == "settled"
    assert Reservation.objects.get(tool_call_id=made["failed"]).status == "released"


def test_deleting_a_job_that_holds_credits_gives_them_back(api: Api) -> None:
    """Deleting a job (the admin's delete) deleted the reservations of its calls with it (CASCADE),
    and left the account's ``reserved`` as it was: credits held that nothing could release any
    more, taken from what the user may spend for good, and check_ledger failing."""
    user = get_user_model().objects.get(username=api.username)
    tool = Tool.objects.select_related("toolset").get(toolset__key="demo", toolset__owner=None, name="sleep")
    job = running_job(user=user)
    call = demo_call(user=user, job=job, tool="sleep", input={"ms": 1})
    assert (
        credits_reserve(user=user, holds=[(call.call_id, price_quote(user=user, toolset=tool.toolset, tool=tool))], exec_job=job)
        == {}
    )
    assert api.get("/api/v1/billing/balance").json()["reserved"] == 1
    job.delete()
    # The reaper's round, once the hold is older than a lease: a call with no record whose job is
    # not running can never run, and what was held for it goes back.
    Reservation.objects.filter(tool_call_id=call.call_id).update(created_at=timezone.now() - timedelta(minutes=5))
    execution_services.tool_calls_close_held()
    account = api.get("/api/v1/billing/balance").json()
    assert (account["balance"], account["reserved"]) == (10_000, 0)
    assert [row for row in ledger_mismatches() if row[0].user_id == user.pk] == []


def _toolset(**fields: object) -> Toolset:
    return Toolset(key="t", name="T", kind="http", is_global=True, price=3, **fields)


def test_price_rules() -> None:
    user = get_user_model().objects.create_user(username=f"price-{uuid.uuid4().hex[:6]}")
    toolset = Toolset.objects.create(key=f"priced_{uuid.uuid4().hex[:6]}", name="P", kind="http", price=3)
    tool = Tool(toolset=toolset, name="x", input_schema={})
    assert price_quote(user=user, toolset=toolset, tool=tool).amount == 3
    tool.price = 7  # the tool's price overrides the toolset's
    assert price_quote(user=user, toolset=toolset, tool=tool).amount == 7
    tool.price = None
    Discount.objects.create(toolset=toolset, percent=50)
    assert price_quote(user=user, toolset=toolset, tool=tool).amount == 2  # 1.5 rounds up
    Discount.objects.create(toolset=toolset, percent=99)
    quote = price_quote(user=user, toolset=toolset, tool=tool)
    assert (quote.amount, quote.due_amount) == (1, 3)  # above zero costs at least 1
    Discount.objects.create(toolset=toolset, percent=100)
    assert price_quote(user=user, toolset=toolset, tool=tool).amount == 0  # but 100% off is free
    Discount.objects.filter(toolset=toolset, percent=100).delete()
    tool.billing_free = True
    assert price_quote(user=user, toolset=toolset, tool=tool) is None
    tool.billing_free = False
    toolset.billing_free = True
    assert price_quote(user=user, toolset=toolset, tool=tool) is None
    toolset.billing_free, toolset.is_global = False, False
    assert price_quote(user=user, toolset=toolset, tool=tool) is None  # only global toolsets are billed
    toolset.delete()


def test_a_discount_for_a_plan_on_a_toolset_is_for_that_plans_users_on_that_toolset_only() -> None:
    users = get_user_model().objects
    member, other = (users.create_user(username=f"disc-{uuid.uuid4().hex[:6]}") for _ in range(2))
    gold = Plan.objects.create(key=f"gold_{uuid.uuid4().hex[:6]}", name="Gold")
    account = account_get(user=member)
    account.plan = gold
    account.save(update_fields=["plan"])
    on, off = (Toolset.objects.create(key=f"disc_{uuid.uuid4().hex[:6]}", name="D", kind="http", price=10) for _ in range(2))
    Discount.objects.create(plan=gold, toolset=on, percent=90)
    try:
        amounts = [
            price_quote(user=user, toolset=toolset, tool=Tool(toolset=toolset, name="x", input_schema={})).amount
            for user, toolset in ((member, on), (other, on), (member, off))
        ]
        assert amounts == [1, 10, 10]  # the plan's users on that toolset; not everyone on it, nor them elsewhere
    finally:
        Toolset.objects.filter(pk__in=[on.pk, off.pk]).delete()
        gold.delete()


def test_the_admin_changes_a_plan_and_nothing_else_of_the_account(api: Api) -> None:
    """A whole row's save wrote back the balance and the held amount the form had read, over the
    calls charged meanwhile."""
    admin = get_user_model().objects.create_superuser(username=f"admin-{uuid.uuid4().hex[:6]}", password="x")
    client = Client()
    client.force_login(admin)
    account = CreditAccount.objects.get(user__username=api.username)
    gold = Plan.objects.create(key=f"gold_{uuid.uuid4().hex[:6]}", name="Gold")
    before = account.balance

    def charged_meanwhile(sender: object, instance: CreditAccount, **kwargs: object) -> None:
        # Between the admin's read of the row and its write: a call's charge and another's hold.
        CreditAccount.objects.filter(pk=instance.pk).update(balance=F("balance") - 5, reserved=F("reserved") + 2)

    form = {"plan": str(gold.pk), "plan_expires_at_0": "", "plan_expires_at_1": ""}
    pre_save.connect(charged_meanwhile, sender=CreditAccount)
    try:
        assert client.post(f"/admin/billing/creditaccount/{account.pk}/change/", form).status_code == 302
        pre_save.disconnect(charged_meanwhile, sender=CreditAccount)
        account.refresh_from_db()
        assert (account.plan_id, account.balance) == (gold.pk, before - 5)
    finally:
        pre_save.disconnect(charged_meanwhile, sender=CreditAccount)
        CreditAccount.objects.filter(pk=account.pk).update(balance=before, reserved=F("reserved") - 2, plan=None)
        gold.delete()


def test_the_admin_adds_and_removes_credits_through_the_ledger_while_calls_hold_some() -> None:
    """README: credits are given through POST /api/v1/billing/credits "or the admin"; the admin had
    no way to (the balance is read-only there, rightly: a form's save wrote over the holds and
    charges of calls running meanwhile). Its action on accounts goes through the ledger, under the
    account's lock, and leaves what running calls hold as it is."""
    admin = get_user_model().objects.create_superuser(username=f"admin-{uuid.uuid4().hex[:6]}", password="x")
    client = Client()
    client.force_login(admin)
    user = get_user_model().objects.create_user(username=f"held-{uuid.uuid4().hex[:6]}")
    call_command("create_api_key", user.username, "--credits", "10", stdout=io.StringIO())
    demo = Toolset.objects.get(key="demo", owner=None)
    quote = price_quote(user=user, toolset=demo, tool=demo.tools.get(name="add"))
    assert quote is not None
    held = f"ptc_{uuid.uuid4().hex}"
    assert credits_reserve(user=user, holds=[(held, quote)]) == {}  # a call in flight
    account = CreditAccount.objects.get(user=user)
    action = {"action": "adjust_credits", "_selected_action": [str(account.pk)]}
    page = client.post("/admin/billing/creditaccount/", action)  # the form: how many, and why
    assert page.status_code == 200 and 'name="amount"' in page.content.decode()
    try:
        for amount, reason in ((25, "goodwill"), (-5, "correction")):
            done = client.post(
                "/admin/billing/creditaccount/",
                {**action, "apply": "1", "amount": amount, "reason": reason, "token": uuid.uuid4()},
            )
            assert done.status_code == 302
        account.refresh_from_db()
        assert (account.balance, account.reserved) == (30, 1)
        entries = LedgerEntry.objects.filter(account=account, created_by=admin).order_by("id")
        assert list(entries.values_list("kind", "delta", "reason")) == [
            ("adjustment", 25, "goodwill"),
            ("adjustment", -5, "correction"),
        ]
        assert not [bad for bad in ledger_mismatches() if bad[0].pk == account.pk]
        refused = client.post("/admin/billing/creditaccount/", {**action, "apply": "1", "amount": 0, "reason": "x"})
        assert refused.status_code == 200 and "must not be 0" in refused.content.decode()
    finally:
        credits_release(tool_call_id=held)


def test_the_admins_credit_form_posted_twice_grants_once() -> None:
    """A browser's resubmit or a double click posted the admin's grant again, and it was granted
    again. The form carries a token of its own, kept on the ledger entry: the same form changes an
    account once, and the second post says so; a form drawn anew grants again."""
    admin = get_user_model().objects.create_superuser(username=f"admin-{uuid.uuid4().hex[:6]}", password="x")
    client = Client()
    client.force_login(admin)
    user = get_user_model().objects.create_user(username=f"twice-{uuid.uuid4().hex[:6]}")
    account = account_get(user=user)
    action = {"action": "adjust_credits", "_selected_action": [str(account.pk)]}
    grant = {**action, "apply": "1", "amount": 25, "reason": "goodwill", "token": str(uuid.uuid4())}
    assert client.post("/admin/billing/creditaccount/", grant).status_code == 302
    again = client.post("/admin/billing/creditaccount/", grant, follow=True).content.decode()
    account.refresh_from_db()
    assert account.balance == 25
    assert list(account.ledger.values_list("delta", flat=True)) == [25]
    assert "This form was applied already" in again and "nothing was changed again" in again
    # The form draws a new token each time it is shown: a new form grants again.
    forms = [client.post("/admin/billing/creditaccount/", action).content.decode() for _ in range(2)]
    tokens = [re.search(r'name="token" value="([0-9a-f-]{36})"', form) for form in forms]
    assert tokens[0] and tokens[1] and tokens[0][1] != tokens[1][1]
    client.post("/admin/billing/creditaccount/", {**grant, "token": tokens[0][1]})
    account.refresh_from_db()
    assert (account.balance, account.ledger.count()) == (50, 2)
    assert not [bad for bad in ledger_mismatches() if bad[0].pk == account.pk]


def test_staff_grant_credits_through_the_ledger(make_api: Callable[..., Api], api: Api) -> None:
    staff = make_api(staff=True)
    before = balance(api)
    response = staff.post("/api/v1/billing/credits", json={"username": api.username, "amount": 25, "reason": "goodwill"})
    assert response.status_code == 201, response.text
    assert response.json()["balance"] == before + 25
    removed = staff.post("/api/v1/billing/credits", json={"username": api.username, "amount": -5, "reason": "correction"})
    assert removed.status_code == 201
    assert balance(api) == before + 20
    entries = LedgerEntry.objects.filter(account__user__username=api.username).order_by("id")
    assert [(e.kind, e.delta) for e in entries][-2:] == [("adjustment", 25), ("adjustment", -5)]
    assert api.post("/api/v1/billing/credits", json={"username": api.username, "amount": 5, "reason": "x"}).status_code == 403


def test_a_grant_retried_with_its_idempotency_key_is_made_once_and_answered_as_the_first_time(
    make_api: Callable[..., Api], api: Api
) -> None:
    """A client that retried POST /api/v1/billing/credits (a timeout, a dropped connection) granted
    twice. Sent with an idempotency_key, a repeat makes nothing and is answered as the first post was
    (the entry, and the balance it left then, though the balance has moved since); another key
    grants again; the key sent for another grant (another amount, reason or user) is 409 conflict,
    nothing changed; without a key each post grants, as before."""
    staff, other = make_api(staff=True), make_api(credits=10)
    before = balance(api)
    grant = {"username": api.username, "amount": 25, "reason": "goodwill", "idempotency_key": str(uuid.uuid4())}
    first = staff.post("/api/v1/billing/credits", json=grant)
    assert first.status_code == 201, first.text
    assert first.json()["balance"] == before + 25
    another = {**grant, "amount": 7, "idempotency_key": str(uuid.uuid4())}
    assert staff.post("/api/v1/billing/credits", json=another).status_code == 201  # another key: granted too
    again = staff.post("/api/v1/billing/credits", json=grant)
    assert (again.status_code, again.json()) == (201, first.json())
    assert balance(api) == before + 32
    entries = LedgerEntry.objects.filter(account__user__username=api.username)
    assert entries.filter(idempotency_key=grant["idempotency_key"]).count() == 1
    made = entries.count()
    for changed in ({"amount": 26}, {"reason": "more goodwill"}, {"username": other.username}):
        refused = staff.post("/api/v1/billing/credits", json={**grant, **changed})
        assert refused.status_code == 409, refused.text
        error = refused.json()["error"]
        assert error["code"] == "conflict" and "a different grant" in error["message"], error
    assert (balance(api), entries.count(), balance(other)) == (before + 32, made, 10)
    assert not LedgerEntry.objects.filter(account__user__username=other.username, idempotency_key__isnull=False).exists()
    plain = {"username": api.username, "amount": 1, "reason": "no key"}
    assert [staff.post("/api/v1/billing/credits", json=plain).status_code for _ in range(2)] == [201, 201]
    assert balance(api) == before + 34


def test_retries_of_one_grant_sent_at_once_grant_once(make_api: Callable[..., Api], api: Api) -> None:
    """A retry sent while the first post is still being answered waits for it, and is answered as
    it is: one entry, every answer the same."""
    staff = make_api(staff=True)
    before = balance(api)
    grant = {"username": api.username, "amount": 3, "reason": "at once", "idempotency_key": str(uuid.uuid4())}
    with ThreadPoolExecutor(max_workers=6) as pool:
        answers = list(pool.map(lambda _: staff.post("/api/v1/billing/credits", json=grant), range(6)))
    assert {answer.status_code for answer in answers} == {201}, [answer.text for answer in answers]
    assert len({answer.text for answer in answers}) == 1
    assert balance(api) == before + 3
    assert LedgerEntry.objects.filter(idempotency_key=grant["idempotency_key"]).count() == 1


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"username": "no-such-user-zz", "amount": 5, "reason": "x"}, "username"),
        ({"username": "{me}", "amount": 1.5, "reason": "x"}, "amount"),
        ({"username": "{me}", "amount": "lots", "reason": "x"}, "amount"),
        ({"username": "{me}", "amount": 5}, "reason"),
        ({"username": "{me}", "amount": 10**30, "reason": "x"}, "amount"),
        ({"username": "{me}", "amount": 2**63, "reason": "x"}, "amount"),
        ({"username": "{me}", "amount": -(2**63), "reason": "x"}, "amount"),
        ({"username": "{me}", "amount": True, "reason": "x"}, "amount"),
        # A key is a UUID as a string, one of the client's own: not a number, not one every client could send.
        ({"username": "{me}", "amount": 5, "reason": "x", "idempotency_key": 12345}, "idempotency_key"),
        ({"username": "{me}", "amount": 5, "reason": "x", "idempotency_key": 0}, "idempotency_key"),
        ({"username": "{me}", "amount": 5, "reason": "x", "idempotency_key": str(uuid.UUID(int=0))}, "idempotency_key"),
        (
            {"username": "{me}", "amount": 5, "reason": "x", "idempotency_key": "ffffffff-ffff-ffff-ffff-ffffffffffff"},
            "idempotency_key",
        ),
        ({"username": "{me}", "amount": 5, "reason": "x", "idempotency_key": [str(uuid.uuid4())]}, "idempotency_key"),
    ],
)
def test_bad_adjustments_get_a_field_error_and_write_nothing(make_api: Callable[..., Api], body: dict, field: str) -> None:
    staff = make_api(staff=True)
    body = {k: (staff.username if v == "{me}" else v) for k, v in body.items()}
    entries = LedgerEntry.objects.count()
    response = staff.post("/api/v1/billing/credits", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "validation_error"
    assert field in response.json()["error"]["details"]
    assert LedgerEntry.objects.count() == entries


def test_an_adjustment_that_would_take_the_balance_out_of_range_is_refused(make_api: Callable[..., Api], api: Api) -> None:
    staff = make_api(staff=True)

    def adjust(amount: int) -> httpx.Response:
        return staff.post("/api/v1/billing/credits", json={"username": api.username, "amount": amount, "reason": "x"})

    top = 2**63 - 1  # the balance column's most
    assert adjust(top - balance(api)).status_code == 201
    entries = LedgerEntry.objects.filter(account__user__username=api.username).count()
    over = adjust(1)
    assert over.status_code == 400, over.text
    assert over.json()["error"]["code"] == "validation_error"
    assert "amount" in over.json()["error"]["details"]
    assert balance(api) == top
    assert LedgerEntry.objects.filter(account__user__username=api.username).count() == entries
    # And at the bottom: two of the largest removals take it past the column's least.
    assert adjust(-top).status_code == 201
    assert adjust(-top).status_code == 201
    assert adjust(-top).status_code == 400
    assert balance(api) == -top


def test_the_usage_chart_is_drawn_server_side(api: Api) -> None:
    api.run("from ptc_tools.demo import Demo\nDemo.add(a=1, b=1)", toolsets=["demo"])
    superuser = get_user_model().objects.create_user(username=f"su-{uuid.uuid4().hex[:6]}", is_staff=True, is_superuser=True)
    client = Client()
    client.force_login(superuser)
    page = client.get("/admin/billing/creditusage/chart/").content.decode()
    assert page.count('aria-label="credits per day"') == 2
    assert "<rect" in page and "demo (" in page and api.username in page
    for url in (
        "/admin/billing/creditaccount/",
        "/admin/billing/ledgerentry/",
        "/admin/billing/reservation/",
        "/admin/billing/creditusage/",
        "/admin/billing/plan/",
        "/admin/billing/discount/",
    ):
        assert client.get(url).status_code == 200, url


def test_usage_is_private(make_api: Callable[..., Api]) -> None:
    alice, bob = make_api(), make_api()
    job = alice.run("from ptc_tools.demo import Demo\nDemo.add(a=1, b=1)", toolsets=["demo"])
    assert bob.get("/api/v1/billing/usage", params={"exec": job["id"]}).json()["count"] == 0


def test_zz_the_ledger_invariant_holds_after_everything() -> None:
    assert ledger_mismatches() == []
    call_command("check_ledger")


@pytest.mark.parametrize("where", ["toolset", "tool"])
def test_negative_prices_get_a_field_error_and_save_nothing(make_api: Callable[..., Api], where: str) -> None:
    staff = make_api(staff=True)
    key = f"neg_{uuid.uuid4().hex[:6]}"
    tool = {
        "name": "x",
        "input_schema": {"type": "object"},
        "http": {"method": "GET", "path": "/x"},
        "price": -3 if where == "tool" else None,
    }
    body = {
        "key": key,
        "name": "Neg",
        "kind": "http",
        "price": -1 if where == "toolset" else 1,
        "config": {"base_url": "http://127.0.0.1:9"},
        "tools": [tool],
    }
    entries = LedgerEntry.objects.count()
    response = staff.post("/api/v1/toolsets", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["details"]
    assert not Toolset.objects.filter(key=key).exists()
    assert LedgerEntry.objects.count() == entries


def test_create_api_key_grants_credits_through_the_ledger(stack_env: dict[str, str]) -> None:
    import subprocess
    import sys

    from tests.stack import ROOT

    username = f"granted-{uuid.uuid4().hex[:6]}"
    subprocess.run(
        [sys.executable, "manage.py", "create_api_key", username, "--create-user", "--credits", "42"],
        cwd=ROOT,
        env=stack_env,
        check=True,
        capture_output=True,
    )
    account = CreditAccount.objects.get(user__username=username)
    assert account.balance == 42
    [entry] = LedgerEntry.objects.filter(account=account)
    assert (entry.kind, entry.delta) == ("grant", 42)
