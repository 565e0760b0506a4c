"""A row held locked by a transaction stuck elsewhere, under a statement timeout long enough to tell
a wait for it from a slow machine (15 s): what must not wait on it (a tools worker's other calls,
the reaper's other rows) goes on within a few seconds, and what needs it ends once the lock goes.

The deployment is its own (its database, its queues). The last tests run a tools worker's or the
reaper's services in this process, on the suite's database (a 30 s timeout), where they can be
given calls that fail after their price was held. tests/execution/test_statement_cancelled.py has
the same at a 1 s timeout, where what is cancelled is tried again.
"""

import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import connection
from django.utils import timezone

from billing.models import CreditAccount, Reservation
from billing.selectors import ledger_mismatches
from billing.services import credits_adjust, credits_reserve, price_quote
from execution.models import ExecJob, ToolCall
from execution.services import calls as services
from ptcproject.db import unless_locked
from ptcproject.errors import call_error
from tests.conftest import Api, own_deployment
from tests.execution.test_statement_cancelled import (
    _account_held,
    _calls_until,
    _check_ledger,
    _ended,
    _held_call,
    _job_copy,
    _LockWaitsSeen,
    _open_call_copy,
    _user_held_as_claimed,
    _user_holder,
    _went_on_during,
)
from tests.factories import demo_call, running_job
from tests.servers import api_key
from tests.stack import ROOT, Stack
from tools.models import Tool

TIMEOUT = 15  # PTC_DB_STATEMENT_TIMEOUT here
HELD_UP = 2.5  # a call that took longer waited on the lock (a demo.add takes milliseconds, a loaded machine's under a second)


@pytest.fixture(scope="module")
def slow_cut(stack_env: dict[str, str]) -> Iterator[Stack]:
    with own_deployment(stack_env, "lock-waits", PTC_DB_STATEMENT_TIMEOUT=str(TIMEOUT)) as stack:
        yield stack


def test_a_finish_waiting_on_a_locked_account_holds_up_no_call_batched_with_its_first_try(slow_cut: Stack) -> None:
    """A billed call's finish waits on its account's row, held locked by a stuck transaction. A tools
    worker records the calls that end together in one statement, a batch at a time: that batch waits
    on the lock briefly, and then each of its calls is recorded alone, the stuck one waiting there.
    Before, the first try of the stuck finish held its batch, and every call of every user that ended
    meanwhile on that worker, until the lock went or the statement timeout (here another user's
    calls, made once it waited, were finished only once that wait had ended, 15 s on)."""
    stuck_name, other_name = f"stuck-{uuid.uuid4().hex[:8]}", f"other-{uuid.uuid4().hex[:8]}"
    stuck = Api(slow_cut.base_url, api_key(slow_cut.env, stuck_name, credits=100), stuck_name)
    other = Api(slow_cut.base_url, api_key(slow_cut.env, other_name, credits=10_000), other_name)
    caller, answers = _held_call(stuck, {"toolset": "demo", "tool": "sleep", "arguments": {"ms": 1000}})
    with _account_held(slow_cut, stuck_name) as holder, _LockWaitsSeen(slow_cut, holder) as waits:
        waits.until(lambda: any(stuck_name in w.users for w in waits.seen.values()), "the stuck call's finish never waited")
        records = _calls_until(other, calls_each=2)
        assert caller.is_alive()  # still waiting on the lock
        seen = dict(waits.seen)
    caller.join(60)
    assert not caller.is_alive()
    # Its waits are brief: any that was long enough for other calls to finish (over 1 s, five times
    # BRIEF_LOCK_WAIT_MS) saw them finish (before: its first try's, the statement timeout, saw none).
    long = [w for w in seen.values() if stuck_name in w.users and w.last - w.first > timedelta(seconds=1)]
    went_on = _went_on_during(slow_cut, other_name, "finished_at", long)
    assert all(went_on), (went_on, long)
    (answer,) = answers
    assert answer.status_code == 200 and answer.json()["status"] == "completed", answer.text
    assert records and all(record.get("status") == "completed" for record in records), [
        r for r in records if r.get("status") != "completed"
    ][:3]
    _check_ledger(slow_cut)


def test_a_claim_waiting_on_a_locked_user_holds_up_no_call_batched_with_its_first_try(slow_cut: Stack) -> None:
    """A job's call is claimed by writing its record, whose foreign key to its user is checked at the
    commit and waits on the user's row, held locked by a stuck transaction. The claims of a tools
    worker's threads go in batches: that batch waits on the lock briefly, then each of its calls is
    claimed alone, the stuck one tried again and again, each try waiting on the lock briefly too, its
    connection given back between them; and the job ends with the call's result once the lock goes.
    Another user's calls, made meanwhile, all complete while the lock is held. No try waits on the
    lock anywhere near the statement timeout (15 s). Before, its batch's first try held every claim of
    every user that came meanwhile until the lock went or the statement timeout; and, later, its try
    alone waited out the lock on one pooled connection, up to the timeout at each try."""
    with (
        _user_held_as_claimed(slow_cut) as (stuck, job, other),
        psycopg.connect(slow_cut.env["DATABASE_URL"], autocommit=True) as conn,
    ):
        with _LockWaitsSeen(slow_cut, _user_holder(conn)) as waits:
            # Its batch's brief wait, then its tries alone: a transaction each.
            waits.until(lambda: len(waits.seen) >= 4, "its claim was not tried again and again alone")
            records = _calls_until(other, calls_each=2)
            assert stuck.get(f"/api/v1/exec/{job['id']}").json()["tool_calls"] == []  # its call's claim still waits
        longest = max(wait.last - wait.first for wait in waits.seen.values())
    final = _ended(stuck, job)
    assert (final["status"], final["return_value"]) == ("completed", 7), (final["error"], final["stderr"][-2000:])
    assert len(records) >= 16 and all(record.get("status") == "completed" for record in records)
    # A try waits BRIEF_LOCK_WAIT_MS (0.2 s) on the lock, the database's own clock; the bound, a third
    # of the timeout, is far from either.
    assert longest < timedelta(seconds=TIMEOUT / 3), f"a claim waited on the lock for {longest}"


def test_calls_waiting_on_a_locked_account_past_the_pool_leave_it_to_other_users_calls(slow_cut: Stack) -> None:
    """More of one user's billed calls than a tools worker's pool has connections (PTC_DB_POOL_MAX)
    finish while a stuck transaction holds their account's row locked: another user's calls on that
    worker complete while the lock is held, and once it goes every one of the stuck calls completes,
    charged once. A finish waits on a lock a moment at a time, giving its connection back between
    tries. Before, each stuck finish held a pooled connection while it waited, for up to the
    statement timeout (15 s here) and again at each of its retries: the stuck calls took the whole
    pool, and the other user's calls, finding none, were retried as if the database were away."""
    many = int(slow_cut.env.get("PTC_DB_POOL_MAX", "20")) + 4  # fewer than the worker's threads (48)
    stuck_name, other_name = f"pooled-{uuid.uuid4().hex[:8]}", f"unpooled-{uuid.uuid4().hex[:8]}"
    stuck = Api(slow_cut.base_url, api_key(slow_cut.env, stuck_name, credits=100), stuck_name)
    other = Api(slow_cut.base_url, api_key(slow_cut.env, other_name, credits=1000), other_name)
    body = {"toolset": "demo", "tool": "sleep", "arguments": {"ms": 3000}}
    answers: list = []
    callers = [
        threading.Thread(target=lambda: answers.append(stuck.post("/api/v1/tools/execute", json=body))) for _ in range(many)
    ]
    for caller in callers:
        caller.start()
    deadline = time.monotonic() + 30
    while stuck.get("/api/v1/billing/balance").json()["reserved"] < many:
        assert time.monotonic() < deadline, "the calls' prices were never all held"
        time.sleep(0.05)
    others: list = []
    with _account_held(slow_cut, stuck_name), psycopg.connect(slow_cut.env["DATABASE_URL"], autocommit=True) as conn:
        # Before the statement timeout cancels the first wait of a stuck finish (which began after
        # this, once its tool returned): the other user's calls take milliseconds.
        until = time.monotonic() + TIMEOUT - 3
        open_calls = (
            "SELECT count(*) FILTER (WHERE c.claimed_at IS NOT NULL), count(*) FROM execution_toolcall c "
            "JOIN auth_user u ON u.id = c.user_id WHERE u.username = %s AND c.status = 'executing'"
        )
        while conn.execute(open_calls, [stuck_name]).fetchone() != (many, many):
            assert time.monotonic() < deadline, "the calls were not all claimed"
            time.sleep(0.05)
        time.sleep(4)  # their tools (3 s) have returned: their finishes wait on the lock
        assert conn.execute(open_calls, [stuck_name]).fetchone() == (many, many)
        add = {"toolset": "demo", "tool": "add", "arguments": {"a": 1, "b": 2}}
        other_callers = [
            threading.Thread(target=lambda: others.append(other.post("/api/v1/tools/execute", json=add))) for _ in range(8)
        ]
        for caller in other_callers:
            caller.start()
        for caller in other_callers:
            caller.join(max(0.0, until - time.monotonic()))
        done = [answer.json() for answer in others]
        assert [record.get("status") for record in done] == ["completed"] * 8, done
        # Still waiting on the lock, each of them: none failed worker_lost, as the reaper failed
        # those whose worker's renewals found no connection either.
        assert conn.execute(open_calls, [stuck_name]).fetchone() == (many, many)
    for caller in [*callers, *other_callers]:
        caller.join(90)
        assert not caller.is_alive()
    records = [answer.json() for answer in answers]
    assert sorted((r["status"], r["output"], r["credits"]) for r in records) == [("completed", {"slept_ms": 3000}, 1)] * many
    balance = stuck.get("/api/v1/billing/balance").json()
    assert (balance["balance"], balance["reserved"]) == (100 - many, 0)
    _check_ledger(slow_cut)


def _user_with_a_job_and_a_call(stack: Stack, name: str) -> tuple[Api, dict, dict]:
    """A new user (``name`` and a suffix), a job of theirs that completed and a call they made over
    HTTP: rows to copy as the jobs and calls a dead worker or a stuck transaction left."""
    username = f"{name}-{uuid.uuid4().hex[:8]}"
    api = Api(stack.base_url, api_key(stack.env, username), username)
    done = api.run("1")
    assert done["status"] == "completed", done
    made = api.post("/api/v1/tools/execute", json={"toolset": "demo", "tool": "echo", "arguments": {"value": 1}}).json()
    return api, done, made


# One round of the reaper, as an exec worker runs it, on a deployment's database (DATABASE_URL): what
# it reaped, and its log (which items it skipped, a row they need held locked).
_REAPER_ROUND = """
import django
django.setup()
from execution.services.jobs import exec_jobs_reap
print(exec_jobs_reap())
"""


def test_a_locked_row_costs_the_reapers_round_next_to_nothing(slow_cut: Stack) -> None:
    """A job lost in the queue and a call whose tools worker died, their rows held locked by stuck
    transactions: the reaper skips each after a brief wait of its own and goes on, and a job whose
    worker died is failed WorkerLost while the locks are held; the two once their locks go. Before,
    each locked row cost the round its wait until PTC_DB_STATEMENT_TIMEOUT (here 15 s), or for as
    long as the lock was held without one. A round is run here with a timeout of an hour, so that
    nothing but the reaper's own wait cuts one short: it ends while the locks are held, having
    skipped both rows (before: it waited on the first until the test gave up on it, a minute)."""
    api, done, made = _user_with_a_job_and_a_call(slow_cut, "reaped")
    lapsed_call = f"standalone_{uuid.uuid4().hex}"
    with psycopg.connect(slow_cut.env["DATABASE_URL"], autocommit=True) as conn:
        lost = _job_copy(conn, done["id"], status="'queued'", created_at="now() - interval '2 hours'", started_at="NULL")
        _open_call_copy(
            conn,
            made["call_id"],
            lapsed_call,
            claimed_at="now() - interval '1 minute'",
            heartbeat_at="now() - interval '1 minute'",
        )
        conn.execute("UPDATE execution_execjob SET finished_at = NULL WHERE id = %s", [lost])
        with psycopg.connect(slow_cut.env["DATABASE_URL"]) as holder:
            holder.execute("SELECT 1 FROM execution_execjob WHERE id = %s FOR UPDATE", [lost])
            holder.execute("SELECT 1 FROM execution_toolcall WHERE call_id = %s FOR UPDATE", [lapsed_call])
            dead = _job_copy(conn, done["id"], status="'running'", heartbeat_at="now() - interval '1 hour'", closed_at="NULL")
            conn.execute("UPDATE execution_execjob SET finished_at = NULL WHERE id = %s", [dead])
            env = {**slow_cut.env, "PTC_DB_STATEMENT_TIMEOUT": "3600"}
            try:
                reaper = subprocess.run(
                    [sys.executable, "-c", _REAPER_ROUND], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
                )
            except subprocess.TimeoutExpired:
                pytest.fail("the reaper's round waited on a locked row for a minute (a round takes a second or two)")
            assert reaper.returncode == 0, reaper.stderr[-2000:]
            skipped = [line for line in reaper.stderr.splitlines() if "skipped this round" in line]
            assert any("failing a job lost in the queue" in line and lost in line for line in skipped), reaper.stderr[-2000:]
            assert any("failing a call whose worker stopped" in line and lapsed_call in line for line in skipped), skipped
            # Reaped by this round, or by the deployment's own reaper, which skips the locked rows as well.
            deadline = time.monotonic() + 30
            while (dead_job := api.get(f"/api/v1/exec/{dead}").json())["status"] == "running":
                assert time.monotonic() < deadline, "the job whose worker died was not reaped while other rows were locked"
                time.sleep(0.2)
            assert api.get(f"/api/v1/exec/{lost}").json()["status"] == "queued"
    assert (dead_job["status"], dead_job["error"]["type"]) == ("failed", "WorkerLost"), dead_job
    deadline = time.monotonic() + 30
    while (lost_job := api.get(f"/api/v1/exec/{lost}").json())["status"] == "queued":
        assert time.monotonic() < deadline, "the lost job was not failed once its row's lock went"
        time.sleep(0.2)
    assert (lost_job["status"], lost_job["error"]["type"]) == ("failed", "WorkerLost"), lost_job
    with psycopg.connect(slow_cut.env["DATABASE_URL"]) as conn:
        deadline = time.monotonic() + 30
        while (row := conn.execute("SELECT status, error FROM execution_toolcall WHERE call_id = %s", [lapsed_call]).fetchone())[
            0
        ] == "executing":
            assert time.monotonic() < deadline, "the call whose worker died was not failed once its row's lock went"
            time.sleep(0.2)
    assert (row[0], row[1]["code"]) == ("failed", "worker_lost"), row


def test_a_running_calls_row_held_locked_holds_up_no_other_calls_lease(slow_cut: Stack) -> None:
    """A tools worker renews the leases of the calls it runs in one statement. With one call's row
    held locked by a stuck transaction, the others' leases are renewed all the same, and a call of
    another user running meanwhile completes; the locked one completes too once the lock goes (the
    reaper judges it a lease after). Before, the renewal waited on the locked row (for up to the
    statement timeout, at every renewal), every lease on that worker lapsed, and the reaper failed
    the other user's call worker_lost while its worker ran it."""
    names = [f"lease-{uuid.uuid4().hex[:8]}" for _ in range(2)]
    apis = [Api(slow_cut.base_url, api_key(slow_cut.env, name, credits=100), name) for name in names]
    answers: list[list] = [[], []]
    body = {"toolset": "demo", "tool": "sleep", "arguments": {"ms": 7000}}
    callers = [
        threading.Thread(target=lambda api=api, out=out: out.append(api.post("/api/v1/tools/execute", json=body)))
        for api, out in zip(apis, answers, strict=True)
    ]
    for caller in callers:
        caller.start()
    claimed = (
        "SELECT c.call_id FROM execution_toolcall c JOIN auth_user u ON u.id = c.user_id "
        "WHERE u.username = %s AND c.status = 'executing' AND c.claimed_at IS NOT NULL"
    )
    with psycopg.connect(slow_cut.env["DATABASE_URL"], autocommit=True) as conn:
        deadline = time.monotonic() + 20
        while not all(conn.execute(claimed, [name]).fetchone() for name in names):
            assert time.monotonic() < deadline, "the calls were not both claimed"
            time.sleep(0.05)
        (locked,) = conn.execute(claimed, [names[0]]).fetchone()
    with psycopg.connect(slow_cut.env["DATABASE_URL"]) as holder:
        holder.execute("SELECT 1 FROM execution_toolcall WHERE call_id = %s FOR UPDATE", [locked])
        time.sleep(5.5)  # past the lease (4 s) of every call whose renewals it held up
    for caller in callers:
        caller.join(60)
        assert not caller.is_alive()
    records = [out[0].json() for out in answers]
    assert [(r["status"], r["error"]) for r in records] == [("completed", None), ("completed", None)], records


def test_a_sessions_row_held_locked_holds_up_no_other_sessions_lease(slow_cut: Stack) -> None:
    """An exec worker renews the leases of the sessions whose sandboxes it holds in one statement.
    With one session's row held locked by a stuck transaction, the others' leases are renewed all
    the same: another session on that worker stays active and runs its next job. Before, the renewal
    waited on the locked row, every lease on that worker lapsed, and the reaper ended the other
    session lost, its sandbox killed, while its worker held it."""
    username = f"sessions-{uuid.uuid4().hex[:8]}"
    api = Api(slow_cut.base_url, api_key(slow_cut.env, username), username)
    sessions = []
    for _ in range(2):
        made = api.post("/api/v1/sessions", json={"toolsets": ["demo"]})
        assert made.status_code == 201, made.text
        sessions.append(made.json())
        assert api.run("x = 6 * 7\nx", session=sessions[-1]["id"])["return_value"] == 42  # its sandbox held by the worker
    with psycopg.connect(slow_cut.env["DATABASE_URL"]) as holder:
        holder.execute("SELECT 1 FROM execution_execsession WHERE id = %s FOR UPDATE", [sessions[0]["id"]])
        time.sleep(6)  # past the lease (4 s) of every session whose renewals it held up, and a reaper's round
        other = api.get(f"/api/v1/sessions/{sessions[1]['id']}").json()
    assert other["status"] == "active", other
    assert api.run("x", session=sessions[1]["id"])["return_value"] == 42


def test_a_job_whose_close_waited_on_a_lock_as_the_reaper_failed_it_is_closed_once_the_lock_goes(slow_cut: Stack) -> None:
    """The reaper fails a job whose worker died, then closes it: fails its queued calls, revokes its
    key, frees its session, announces its end. A statement of the close that waited on a row held
    locked (here its queued call's) was cancelled a moment later (the reaper's brief lock wait), after
    the job was stored failed and closed: nothing closed it again, and its call stayed open until
    the reaper's abandoned-call sweep failed it worker_lost. The job is now closed by whoever claims
    its close (closed_at), as every ended job is: a close cut short is found and done again once the
    lock goes, its call failed job_ended."""
    api, done, made = _user_with_a_job_and_a_call(slow_cut, "closed")
    queued_call = f"call_{uuid.uuid4().hex}"
    with psycopg.connect(slow_cut.env["DATABASE_URL"], autocommit=True) as conn:
        dead = _job_copy(conn, done["id"], status="'running'", heartbeat_at="now() - interval '1 hour'", closed_at="NULL")
        conn.execute("UPDATE execution_execjob SET finished_at = NULL WHERE id = %s", [dead])
        with psycopg.connect(slow_cut.env["DATABASE_URL"]) as holder:
            # Its call queued, not yet claimed by a tools worker, and its row held locked.
            _open_call_copy(
                conn,
                made["call_id"],
                queued_call,
                exec_job_id=f"'{dead}'",
                started_at="now()",
                claimed_at="NULL",
                heartbeat_at="NULL",
            )
            holder.execute("SELECT 1 FROM execution_toolcall WHERE call_id = %s FOR UPDATE", [queued_call])
            deadline = time.monotonic() + 20
            while api.get(f"/api/v1/exec/{dead}").json()["status"] == "running":
                assert time.monotonic() < deadline, "the job whose worker died was not reaped"
                time.sleep(0.2)
            time.sleep(1)  # its close has waited on the call's row, and was cancelled
        # As if a lease and PTC_DB_RETRY_SECONDS had passed since it was failed: a close of it left
        # undone is now the reaper's to do again.
        conn.execute("UPDATE execution_execjob SET finished_at = now() - interval '10 minutes' WHERE id = %s", [dead])
        deadline = time.monotonic() + 20
        while (row := conn.execute("SELECT status, error FROM execution_toolcall WHERE call_id = %s", [queued_call]).fetchone())[
            0
        ] == "executing":
            assert time.monotonic() < deadline, "the job's queued call was left open: its close was never done again"
            time.sleep(0.2)
        closed = conn.execute("SELECT status, closed_at FROM execution_execjob WHERE id = %s", [dead]).fetchone()
    assert (row[0], row[1]["code"]) == ("failed", "job_ended"), row
    assert closed[0] == "failed" and closed[1] is not None, closed


def test_failed_calls_whose_account_is_held_locked_hold_up_no_other_call_and_give_back_their_credits_once_it_goes(
    django_db_setup: str,
) -> None:
    """A tools worker's threads finish failed billed calls together: one user's account row is held
    locked by a stuck transaction, another's is not. The other user's calls are recorded and their
    credits given back at once; the stuck user's calls wait for the lock each on its own thread, and
    give back what was held for them once it goes, each once. Before, the batch gave back each
    stuck call's hold after waiting on the lock a moment for each (every call batched with them and
    after them waited as long), and left it held, for the reaper's close a lease later."""
    tool = Tool.objects.select_related("toolset").get(toolset__key="demo", toolset__owner=None, name="fail")
    made: dict[str, list[ToolCall]] = {}
    for name in ("stuck", "other"):
        user = get_user_model().objects.create_user(username=f"{name}-{uuid.uuid4().hex[:8]}")
        credits_adjust(user=user, amount=100, reason="test")
        # 15 each: 30 in all, past this process's pool (PTC_DB_POOL_MAX, 20), which a stuck call's
        # waits no longer hold (test_calls_waiting_out_a_locked_account_take_a_quarter_of_the_pool_at_most).
        made[name] = [demo_call(user=user, tool="fail", input={"message": "no"}) for _ in range(15)]
        quote = price_quote(user=user, toolset=tool.toolset, tool=tool)
        assert quote is not None and quote.amount == 1
        assert credits_reserve(user=user, holds=[(call.call_id, quote) for call in made[name]]) == {}
    took: dict[str, float] = {}

    def run(call: ToolCall) -> None:
        call.price_held = True  # type: ignore[attr-defined]  # as its claim says
        started = time.monotonic()
        try:
            services._tool_call_run(call=call, tool=tool)
        finally:
            took[call.call_id] = time.monotonic() - started
            connection.close()

    runners = {name: [threading.Thread(target=run, args=(call,)) for call in calls] for name, calls in made.items()}
    with psycopg.connect(django_db_setup) as holder:
        holder.execute("SELECT 1 FROM billing_creditaccount WHERE user_id = %s FOR UPDATE", [made["stuck"][0].user_id])
        for stuck, other in zip(runners["stuck"], runners["other"], strict=True):
            stuck.start()
            other.start()
        for thread in runners["other"]:
            thread.join(20)
            assert not thread.is_alive()
        other_account = CreditAccount.objects.get(user_id=made["other"][0].user_id)
        assert (other_account.balance, other_account.reserved) == (100, 0)  # while the lock is held
        assert all(thread.is_alive() for thread in runners["stuck"])  # each waits on the lock
    for thread in runners["stuck"]:
        thread.join(30)
        assert not thread.is_alive()
    held_up = sorted(round(took[call.call_id], 2) for call in made["other"] if took[call.call_id] > HELD_UP)
    assert not held_up, held_up
    for calls in made.values():
        records = ToolCall.objects.filter(call_id__in=[call.call_id for call in calls])
        assert sorted((r.status, r.error["code"], r.credits) for r in records) == [("failed", "tool_failed", 0)] * len(calls)
        assert set(Reservation.objects.filter(tool_call_id__in=[c.call_id for c in calls]).values_list("status", flat=True)) == {
            "released"
        }
    stuck_account = CreditAccount.objects.get(user_id=made["stuck"][0].user_id)
    assert (stuck_account.balance, stuck_account.reserved) == (100, 0)
    assert ledger_mismatches() == []


def test_calls_waiting_out_a_locked_account_take_a_quarter_of_the_pool_at_most(django_db_setup: str) -> None:
    """A tools worker's calls of one user finish while a stuck transaction holds the user's account
    row locked: each waits on the lock a moment at a time, its connection given back between tries,
    and once its own try was cancelled so, its next ones take turns, a quarter of this process's pool
    (PTC_DB_POOL_MAX) at once at most, whatever the number of calls waiting. Once the lock goes each
    completes, charged once. Before, each waited out the lock holding its connection (here all 16 at
    once); with brief tries and no bound on them, the tries of calls that started together came
    together (11 of 16 at once here; 16 of 24 and 20 of 40 on a deployment's tools worker)."""
    tool = Tool.objects.select_related("toolset").get(toolset__key="demo", toolset__owner=None, name="add")
    user = get_user_model().objects.create_user(username=f"turns-{uuid.uuid4().hex[:8]}")
    credits_adjust(user=user, amount=100, reason="test")
    calls = [demo_call(user=user) for _ in range(16)]
    quote = price_quote(user=user, toolset=tool.toolset, tool=tool)
    assert quote is not None and quote.amount == 1
    assert credits_reserve(user=user, holds=[(call.call_id, quote) for call in calls]) == {}

    def run(call: ToolCall) -> None:
        call.price_held = True  # type: ignore[attr-defined]  # as its claim says
        try:
            services._tool_call_run(call=call, tool=tool)
        finally:
            connection.close()

    runners = [threading.Thread(target=run, args=(call,)) for call in calls]
    waiting = "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
    most = 0
    with psycopg.connect(django_db_setup) as holder, psycopg.connect(django_db_setup, autocommit=True) as watcher:
        holder.execute("SELECT 1 FROM billing_creditaccount WHERE user_id = %s FOR UPDATE", [user.pk])
        for runner in runners:
            runner.start()
        time.sleep(2)  # each call's first try alone, at once after its batch's, is done: the next take turns
        until = time.monotonic() + 4
        while time.monotonic() < until:
            most = max(most, watcher.execute(waiting).fetchone()[0])
            time.sleep(0.01)
        assert all(runner.is_alive() for runner in runners)  # each waits on the lock
    assert 0 < most <= max(1, settings.PTC_DB_POOL_MAX // 4), most
    for runner in runners:
        runner.join(30)
        assert not runner.is_alive()
    records = ToolCall.objects.filter(call_id__in=[call.call_id for call in calls])
    assert sorted((r.status, r.output, r.credits) for r in records) == [("completed", 3, 1)] * len(calls)
    account = CreditAccount.objects.get(user=user)
    assert (account.balance, account.reserved) == (100 - len(calls), 0)
    assert ledger_mismatches() == []


def _adds_built(user: Any, job: ExecJob, tool: Tool, count: int) -> list[ToolCall]:
    """``count`` calls of demo.add (1 + 2) of ``user``'s ``job``, built (checked, not yet recorded)."""
    return [
        services.tool_call_build(
            call_id=f"ptc_{uuid.uuid4().hex}",
            user=user,
            job=job,
            toolset="demo",
            tool="add",
            arguments={"a": 1, "b": 2},
            found=tool,
        )
        for _ in range(count)
    ]


def test_a_jobs_queued_calls_failed_as_it_closes_give_back_their_holds_when_the_close_is_done_again(django_db_setup: str) -> None:
    """A job's close fails the calls it left queued, and gives back what was held for them. In the
    reaper's round, with their account's row held locked by a stuck transaction, the close is cut
    short (its statements wait on a lock a moment) and done again in a later round, once the lock
    goes: the calls are failed then, their holds given back with them. Before, the first try left
    the calls failed and their holds held; the second found nothing left to fail, and the holds
    stayed until the reaper's close of held credits, a lease later."""
    from ptcproject.accounts.services import user_with_key_create

    user, _ = user_with_key_create(username=f"closed-{uuid.uuid4().hex[:6]}", create_user=True, staff=False, credits=10)
    job = running_job(user=user)
    tool = Tool.objects.select_related("toolset").get(toolset__key="demo", toolset__owner=None, name="add")
    calls = _adds_built(user, job, tool, 3)
    assert services.tool_calls_reserve(calls=[(call.call_id, tool) for call in calls], user=user, job=job) == {}
    ids = [call.call_id for call in calls]

    def close() -> list[str]:
        return services.tool_calls_fail_queued(calls, error=call_error("job_ended", services.JOB_ENDED_MESSAGE), running=False)

    with psycopg.connect(django_db_setup) as holder:
        holder.execute("SELECT 1 FROM billing_creditaccount WHERE user_id = %s FOR UPDATE", [user.pk])
        assert unless_locked(close, what="closing an ended job") is None
    assert not ToolCall.objects.filter(call_id__in=ids).exists()  # nothing done: all of it is done again
    assert sorted(unless_locked(close, what="closing an ended job") or []) == sorted(ids)
    records = ToolCall.objects.filter(call_id__in=ids)
    assert sorted((r.status, r.error["code"]) for r in records) == [("failed", "job_ended")] * 3
    assert set(Reservation.objects.filter(tool_call_id__in=ids).values_list("status", flat=True)) == {"released"}
    account = CreditAccount.objects.get(user=user)
    assert (account.balance, account.reserved) == (10, 0)
    assert ledger_mismatches() == []


def _others_done_past_the_stuck(threads: dict[str, list[threading.Thread]]) -> None:
    """Start the ``stuck`` user's threads and, once their first tries wait on the lock (their
    batches' brief waits over: each tried alone), the ``other`` user's; wait for the latter, within
    PTC_DB_STATEMENT_TIMEOUT (30 s), which a stuck try waited out before."""
    for thread in threads["stuck"]:
        thread.start()
    time.sleep(2)
    for thread in threads["other"]:
        thread.start()
    for thread in threads["other"]:
        thread.join(20)
        assert not thread.is_alive()


def test_claims_waiting_on_a_locked_user_past_the_pool_leave_it_to_other_users_calls(
    django_db_setup: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """More of one user's job calls than this process's pool has connections (PTC_DB_POOL_MAX) are
    claimed while a stuck transaction holds the user's row locked: each claim writes the call's
    record, whose foreign key to the user is checked at the commit, and waits on that lock. Another
    user's calls, claimed meanwhile by the same worker's threads, complete while the lock is held;
    once it goes every stuck call is claimed and run once, charged once. Before, each stuck claim,
    tried alone after its batch's brief wait, waited out the lock holding a pooled connection (up to
    PTC_DB_STATEMENT_TIMEOUT, 30 s here): they took the whole pool, and the other user's claims found
    no connection (ClaimUnrun, their task's retry as if the database were away)."""
    from ptcproject.accounts.services import user_with_key_create

    ran: list[str] = []
    real = services.tool_run

    def counting(**kwargs: Any) -> Any:
        ran.append(threading.current_thread().name)
        return real(**kwargs)

    monkeypatch.setattr(services, "tool_run", counting)
    tool = Tool.objects.select_related("toolset").get(toolset__key="demo", toolset__owner=None, name="add")
    queued: dict[str, list[ToolCall]] = {}
    users = {}
    for name, count in (("stuck", settings.PTC_DB_POOL_MAX + 4), ("other", 8)):
        user, _ = user_with_key_create(
            username=f"claim-{name}-{uuid.uuid4().hex[:6]}", create_user=True, staff=False, credits=100
        )
        job = running_job(user=user)
        users[name] = user
        queued[name] = _adds_built(user, job, tool, count)
        assert services.tool_calls_reserve(calls=[(call.call_id, tool) for call in queued[name]], user=user, job=job) == {}
    failures: list[BaseException] = []

    def execute(call: ToolCall) -> None:
        try:
            services.tool_call_execute(call_id=call.call_id, record=services.tool_call_signed(call))
        except BaseException as exc:  # asserted on below
            failures.append(exc)
        finally:
            connection.close()

    threads = {
        name: [threading.Thread(target=execute, args=(call,), name=call.call_id) for call in calls]
        for name, calls in queued.items()
    }
    stuck_ids = [call.call_id for call in queued["stuck"]]
    with psycopg.connect(django_db_setup) as holder:
        holder.execute("SELECT 1 FROM auth_user WHERE id = %s FOR UPDATE", [users["stuck"].pk])
        _others_done_past_the_stuck(threads)
        assert failures == []
        records = ToolCall.objects.filter(call_id__in=[call.call_id for call in queued["other"]])
        assert sorted((r.status, r.output, r.credits) for r in records) == [("completed", 3, 1)] * 8  # while the lock is held
        assert all(thread.is_alive() for thread in threads["stuck"])  # each waits on the lock
        assert not ToolCall.objects.filter(call_id__in=stuck_ids).exists()
    for thread in threads["stuck"]:
        thread.join(60)
        assert not thread.is_alive()
    assert failures == []
    records = ToolCall.objects.filter(call_id__in=stuck_ids)
    assert sorted((r.status, r.output, r.credits) for r in records) == [("completed", 3, 1)] * len(stuck_ids)
    assert sorted(ran) == sorted([*stuck_ids, *(call.call_id for call in queued["other"])])  # each run once
    for name, calls in queued.items():
        account = CreditAccount.objects.get(user=users[name])
        assert (account.balance, account.reserved) == (100 - len(calls), 0)
    assert ledger_mismatches() == []


@pytest.mark.parametrize("failure", ["tool_disabled", "internal_error"])
def test_failures_waiting_on_a_locked_account_past_the_pool_leave_it_to_other_users_calls(
    django_db_setup: str, failure: str
) -> None:
    """More of one user's claimed calls than this process's pool has connections fail (their tool
    disabled since they were made: ``_tool_call_fail_retried``; their task crashed:
    ``tool_call_abort``) while a stuck transaction holds the user's account row locked: giving back
    what was held for each waits on that lock. Another user's calls failed so meanwhile are recorded,
    their holds given back, while the lock is held; once it goes every stuck call is failed once, its
    hold given back once. Before, each stuck failure waited out the lock holding a pooled connection
    (up to PTC_DB_STATEMENT_TIMEOUT, 30 s here): they took the whole pool, and the other user's
    failures found no connection until the first waits were cancelled."""

    def fail(call_id: str) -> None:
        if failure == "tool_disabled":
            services._tool_call_fail_retried(call_id, "tool_disabled", "disabled")
        else:
            services.tool_call_abort(call_id=call_id)

    tool = Tool.objects.select_related("toolset").get(toolset__key="demo", toolset__owner=None, name="add")
    made: dict[str, list[ToolCall]] = {}
    for name, count in (("stuck", settings.PTC_DB_POOL_MAX + 4), ("other", 8)):
        user = get_user_model().objects.create_user(username=f"fail-{name}-{uuid.uuid4().hex[:8]}")
        credits_adjust(user=user, amount=100, reason="test")
        made[name] = [demo_call(user=user, claimed_at=timezone.now()) for _ in range(count)]
        quote = price_quote(user=user, toolset=tool.toolset, tool=tool)
        assert quote is not None and quote.amount == 1
        assert credits_reserve(user=user, holds=[(call.call_id, quote) for call in made[name]]) == {}
    failures: list[BaseException] = []

    def run(call: ToolCall) -> None:
        try:
            fail(call.call_id)
        except BaseException as exc:  # asserted on below
            failures.append(exc)
        finally:
            connection.close()

    threads = {name: [threading.Thread(target=run, args=(call,)) for call in calls] for name, calls in made.items()}
    ids = {name: [call.call_id for call in calls] for name, calls in made.items()}
    with psycopg.connect(django_db_setup) as holder:
        holder.execute("SELECT 1 FROM billing_creditaccount WHERE user_id = %s FOR UPDATE", [made["stuck"][0].user_id])
        _others_done_past_the_stuck(threads)
        assert failures == []
        assert set(Reservation.objects.filter(tool_call_id__in=ids["other"]).values_list("status", flat=True)) == {"released"}
        assert all(thread.is_alive() for thread in threads["stuck"])  # each waits on the lock
    for thread in threads["stuck"]:
        thread.join(60)
        assert not thread.is_alive()
    assert failures == []
    for name, calls in made.items():
        records = ToolCall.objects.filter(call_id__in=ids[name])
        assert sorted((r.status, r.error["code"], r.credits) for r in records) == [("failed", failure, 0)] * len(calls)
        assert set(Reservation.objects.filter(tool_call_id__in=ids[name]).values_list("status", flat=True)) == {"released"}
        account = CreditAccount.objects.get(user_id=calls[0].user_id)
        assert (account.balance, account.reserved) == (100, 0)
    assert ledger_mismatches() == []
