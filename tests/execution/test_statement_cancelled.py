"""Statements PostgreSQL cancels (PTC_DB_STATEMENT_TIMEOUT) under a running deployment: a row held
locked by another transaction past the timeout is a cancel, not an outage, and what the workers
were doing still ends as it should, recorded once and charged exactly.

The deployment is its own (its database, its queues), with a statement timeout of 1 s.
"""

import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime

import psycopg
import pytest

from tests.conftest import TEST_DATABASE_URL, Api, own_deployment
from tests.servers import PostgresProxy, api_key
from tests.stack import ROOT, Stack


@pytest.fixture(scope="module")
def cut(stack_env: dict[str, str]) -> Iterator[Stack]:
    with own_deployment(stack_env, "statement-cancelled", PTC_DB_STATEMENT_TIMEOUT="1") as stack:
        yield stack


@contextmanager
def _account_held(stack: Stack, username: str) -> Iterator[int]:
    """Hold ``username``'s credit account row locked for the block, as a stuck transaction would;
    yield the holding backend's pid."""
    with psycopg.connect(stack.env["DATABASE_URL"]) as conn:
        conn.execute(
            "SELECT 1 FROM billing_creditaccount a JOIN auth_user u ON u.id = a.user_id WHERE u.username = %s FOR UPDATE OF a",
            [username],
        )
        yield conn.info.backend_pid


def _held_call(api: Api, body: dict, timeout: float = 90) -> tuple[threading.Thread, list]:
    """Post the call ``body`` to /tools/execute from a thread (its answer waited for ``timeout``);
    return the thread and the list its answer (the response) goes to, once the call's price is held."""
    answers: list = []
    caller = threading.Thread(target=lambda: answers.append(api.post("/api/v1/tools/execute", json=body, timeout=timeout)))
    caller.start()
    deadline = time.monotonic() + 20
    while api.get("/api/v1/billing/balance").json()["reserved"] < 1:
        assert time.monotonic() < deadline, "the call's price was never held"
        time.sleep(0.05)
    return caller, answers


def _check_ledger(stack: Stack) -> None:
    checked = subprocess.run(
        [sys.executable, "manage.py", "check_ledger"], cwd=ROOT, env=stack.env, capture_output=True, text=True
    )
    assert checked.returncode == 0 and "Every balance equals the sum of its ledger." in checked.stdout, checked.stderr


@pytest.fixture
def brief_retries(stack_env: dict[str, str]) -> Iterator[Stack]:
    """A deployment whose workers try a statement again for 2 s only (PTC_DB_RETRY_SECONDS), at the
    same 1 s timeout: a lock held longer outlasts a worker's retries. Its calls' code waits for them
    10 minutes (PTC_DEFAULT_TOOL_TIMEOUT), longer than all of a task's retries, and their leases
    outlast the longest wait between two of those (8 s; the suite's 4 s lease lapsed in it, and the
    reaper failed the call between two retries). For one test at a time, before ``cut`` starts: two
    deployments at once hold twice the connections of one."""
    env = {"PTC_DB_STATEMENT_TIMEOUT": "1", "PTC_DB_RETRY_SECONDS": "2", "PTC_DEFAULT_TOOL_TIMEOUT": "600"}
    env["PTC_JOB_LEASE_SECONDS"] = "20"
    with own_deployment(stack_env, "brief-retries", **env) as stack:
        yield stack


def test_a_calls_result_the_database_did_not_take_within_the_retries_is_recorded_by_its_tasks_retry(
    brief_retries: Stack,
) -> None:
    """A billed call's finish waits on its account's row, held locked past the worker's retries of it
    (2 s): the result goes with its task's retry, which records it once the lock goes, the call
    completed with its result, charged once, nothing left held. Before, the retry found the call
    claimed under the lease the worker's retries had renewed and dropped it as a duplicate: its result
    was lost, and a lease later the reaper failed it worker_lost, as if its worker had died."""
    username = f"outlasted-{uuid.uuid4().hex[:8]}"
    api = Api(brief_retries.base_url, api_key(brief_retries.env, username, credits=100), username)
    caller, answers = _held_call(api, {"toolset": "demo", "tool": "sleep", "arguments": {"ms": 1500}})
    # Locked before the tool returns (1.5 s), past the worker's retries (2 s), under its task's retry.
    with _account_held(brief_retries, username):
        time.sleep(6)
    _slept_and_charged_once(brief_retries, api, caller, answers)


@pytest.fixture
def reply_lost(stack_env: dict[str, str]) -> Iterator[tuple[Stack, PostgresProxy]]:
    """A deployment whose tools worker reaches PostgreSQL through a proxy that drops a connection
    when told (PostgresProxy), at the default statement timeout (30 s): a claim waits on a lock long
    enough to be cut there. For one test, before ``cut`` starts."""
    proxy = PostgresProxy(TEST_DATABASE_URL)
    try:
        with own_deployment(stack_env, "reply-lost") as stack:
            stack.tools_worker.stop()
            stack.tools_worker.env = {**stack.env, "DATABASE_URL": proxy.url(stack.env["DATABASE_URL"])}
            stack.tools_worker.start()
            yield stack, proxy
    finally:
        proxy.stop()


def test_a_claim_committed_whose_reply_was_lost_runs_at_its_tasks_retry(reply_lost: tuple[Stack, PostgresProxy]) -> None:
    """A job's call is claimed (its record written, claimed) by a statement that waits at its commit
    on the user's row, held locked by a stuck transaction; the tools worker's connection drops
    there, and the lock then goes: the claim commits, its reply lost, the worker told the
    connection failed. Its task's retry knows that claim for its own try's, takes it over and runs
    the call once, and the job ends with its result. Before, the retry found the call claimed under a
    fresh lease and dropped it as a duplicate; a lease later the reaper failed it worker_lost (no
    worker had died, and nothing had run it), and the job with it."""
    stack, proxy = reply_lost
    waiting = (
        "SELECT client_port FROM pg_stat_activity WHERE datname = current_database() "
        "AND wait_event_type = 'Lock' AND query LIKE '%INSERT INTO execution_toolcall%'"
    )
    with psycopg.connect(stack.env["DATABASE_URL"], autocommit=True) as conn:
        with _user_held_as_claimed(stack) as (stuck, job, _):
            # Its claim, alone after its batch's brief wait, waits at its commit: its connection cut there.
            deadline = time.monotonic() + 30
            while (claiming := conn.execute(waiting).fetchone()) is None:
                assert time.monotonic() < deadline, "the call's claim never waited on the user's row"
                time.sleep(0.05)
            proxy.cut(claiming[0])
            time.sleep(1)  # the worker has had its error
        final = _ended(stuck, job)
        assert (final["status"], final["return_value"]) == ("completed", 7), (final["error"], final["stderr"][-2000:])
        calls = conn.execute("SELECT status, output FROM execution_toolcall WHERE exec_job_id = %s", [job["id"]]).fetchall()
    assert calls == [("completed", 7)]


KEPT = b"kept for the reaper to record"


def test_a_calls_result_the_database_did_not_take_within_all_its_tasks_retries_is_recorded_by_the_reaper(
    brief_retries: Stack,
) -> None:
    """A billed call's finish waits on its account's row, held locked past all 10 of its task's
    retries (each try 2 s, about 95 s in all): the last one keeps the result where the reaper finds
    it, saying so once in the tools worker's log with the call's id, and the reaper records it once
    the lock goes: the call completed with its result, charged once, nothing left held. Before, the
    result was lost with the last retry, and a lease later the reaper failed the call worker_lost
    (its tool had run: its price held, never charged, given back)."""
    username = f"spent-{uuid.uuid4().hex[:8]}"
    api = Api(brief_retries.base_url, api_key(brief_retries.env, username, credits=100), username)
    logged = brief_retries.tools_worker.log.stat().st_size
    caller, answers = _held_call(api, {"toolset": "demo", "tool": "sleep", "arguments": {"ms": 1500}}, timeout=400)
    with _account_held(brief_retries, username):
        # Held until the task's last try has failed (said in the log either way), well past the lease.
        deadline = time.monotonic() + 300
        while (last := _log_since(brief_retries, logged)).count(KEPT) + last.count(b"raised unexpected") == 0:
            assert time.monotonic() < deadline, "the call's task never gave up"
            time.sleep(1)
    record = _slept_and_charged_once(brief_retries, api, caller, answers)
    said = [line for line in _log_since(brief_retries, logged).splitlines() if KEPT in line]
    assert len(said) == 1 and record["call_id"].encode() in said[0], said


def _slept_and_charged_once(stack: Stack, api: Api, caller: threading.Thread, answers: list) -> dict:
    """The answer of ``caller``'s held call of demo.sleep(1500) (``_held_call``): completed with its
    output, charged once (1 of 100 credits), nothing left held, the ledger exact. Return its record."""
    caller.join(120)
    assert not caller.is_alive()
    (record,) = [answer.json() for answer in answers]
    assert record["status"] == "completed", record["error"]
    assert (record["output"], record["credits"]) == ({"slept_ms": 1500}, 1)
    balance = api.get("/api/v1/billing/balance").json()
    assert (balance["balance"], balance["reserved"]) == (99, 0)
    _check_ledger(stack)
    return record


def _log_since(stack: Stack, offset: int) -> bytes:
    """What ``stack``'s tools worker logged past ``offset``."""
    with stack.tools_worker.log.open("rb") as log:
        log.seek(offset)
        return log.read()


def test_a_tools_workers_finish_cancelled_by_the_statement_timeout_is_recorded_once_the_lock_goes(cut: Stack) -> None:
    """A billed call's finish (its record and its settle, one statement) waits on its account's row,
    held locked past the statement timeout: cancelled, it is tried again until the lock goes, and
    the call ends completed with its result, charged once, nothing left held. Before, the cancel
    went up to the task's retry, whose claim dropped the call as a duplicate of one still running:
    its result was lost, and once its lease lapsed the reaper failed it worker_lost, as if its
    worker had died."""
    username = f"cancel-{uuid.uuid4().hex[:8]}"
    api = Api(cut.base_url, api_key(cut.env, username, credits=100), username)
    caller, answers = _held_call(api, {"toolset": "demo", "tool": "sleep", "arguments": {"ms": 1500}})
    # Locked before the tool returns (1.5 s), held past the timeout and the call's lease (4 s).
    with _account_held(cut, username):
        time.sleep(7)
    caller.join(60)
    assert not caller.is_alive()
    (record,) = [answer.json() for answer in answers]
    assert record["status"] == "completed", record["error"]
    assert (record["output"], record["credits"]) == ({"slept_ms": 1500}, 1)
    assert api.get("/api/v1/billing/balance").json() | {"plan": None, "plan_expires_at": None} == {
        "balance": 99,
        "reserved": 0,
        "plan": None,
        "plan_expires_at": None,
    }
    _check_ledger(cut)


class _LockWaitsSeen:
    """What waits on the lock the backend ``holder`` holds: sampled every 10 ms, from a thread of its
    own, for the block (``with``). ``seen`` has each transaction found waiting on it (its xid): the
    users whose calls' rows it had written (an uncommitted update leaves its xid as the old row's
    xmax: a tools worker's batch of claims or finishes names every call in it there), and when it was
    first and last found waiting (the database's clock, the workers' too)."""

    SAMPLE = (
        "SELECT a.backend_xid::text, u.username, clock_timestamp() FROM pg_stat_activity a "
        "LEFT JOIN execution_toolcall c ON c.xmax = a.backend_xid LEFT JOIN auth_user u ON u.id = c.user_id "
        "WHERE a.datname = current_database() AND a.backend_xid IS NOT NULL AND %s = ANY(pg_blocking_pids(a.pid))"
    )

    def __init__(self, stack: Stack, holder: int) -> None:
        self.url, self.holder = stack.env["DATABASE_URL"], holder
        self.seen: dict[str, _Wait] = {}
        self.at: datetime | None = None  # the last sample's time
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample)

    def _sample(self) -> None:
        with psycopg.connect(self.url, autocommit=True) as conn:
            while not self._stop.is_set():
                for xid, username, at in conn.execute(self.SAMPLE, [self.holder]).fetchall():
                    wait = self.seen.setdefault(xid, _Wait(first=at, last=at))
                    wait.last = at
                    wait.users.update([username] if username else [])
                self.at = conn.execute("SELECT clock_timestamp()").fetchone()[0]
                time.sleep(0.01)

    def until(self, enough: Callable[[], bool], what: str, seconds: float = 60) -> None:
        """Wait until ``enough()``; ``seconds`` only a guard against never."""
        deadline = time.monotonic() + seconds
        while not enough():
            assert self._thread.is_alive() and time.monotonic() < deadline, what
            time.sleep(0.02)

    def __enter__(self) -> "_LockWaitsSeen":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


@dataclass
class _Wait:
    first: datetime
    last: datetime
    users: set[str] = field(default_factory=set)


def _went_on_during(stack: Stack, username: str, column: str, waits: list[_Wait]) -> list[int]:
    """For each of ``waits``, how many of ``username``'s calls were claimed or finished (``column``,
    the time a worker's batch took for it) while it was found waiting: none while a tools worker's
    batch waits on a lock, which runs one at a time."""
    with psycopg.connect(stack.env["DATABASE_URL"]) as conn:
        return [
            conn.execute(
                f"SELECT count(*) FROM execution_toolcall c JOIN auth_user u ON u.id = c.user_id "
                f"WHERE u.username = %s AND c.{column} > %s AND c.{column} < %s",
                [username, wait.first, wait.last],
            ).fetchone()[0]
            for wait in waits
        ]


def _calls_until(
    api: Api, enough: Callable[[], bool] | None = None, threads: int = 8, seconds: float = 120, calls_each: int = 0
) -> list[dict]:
    """Make calls of demo.add for ``api`` from ``threads`` threads until ``enough()`` (or ``calls_each``
    each; ``seconds`` only a guard against never); return their records."""
    records: list[dict] = []
    deadline = time.monotonic() + seconds
    if enough is None:
        enough = lambda: len(records) >= threads * calls_each  # noqa: E731

    def calls() -> None:
        while not enough() and time.monotonic() < deadline:
            body = {"toolset": "demo", "tool": "add", "arguments": {"a": 1, "b": 2}}
            records.append(api.http.post("/api/v1/tools/execute", json=body, timeout=60).json())

    with ThreadPoolExecutor(threads) as pool:
        for done in [pool.submit(calls) for _ in range(threads)]:
            done.result()
    assert enough(), f"not enough within {seconds} s"
    return records


def test_a_finish_waiting_on_a_locked_account_holds_up_no_other_users_calls(cut: Stack) -> None:
    """While one user's call waits to be recorded (its account's row held locked past the timeout,
    its finish tried again until the lock goes), another user's calls on the same tools worker go on
    as usual. A tools worker records the calls that end at once in one statement, a batch at a time:
    the waiting call's retries went through the batches, and each held up every other call's finish
    for a timeout, and failed those batched with it (here 37 of the other user's calls took over
    0.5 s). Now only its first try goes through them (before the other user's calls here): none of
    its retries, eight of which wait on the lock while those calls go on, is another's call's
    statement, other calls are finished while most of them wait (before: while none), and they all
    complete while the lock is held, the stuck call still executing."""
    stuck_name, other_name = f"stuck-{uuid.uuid4().hex[:8]}", f"other-{uuid.uuid4().hex[:8]}"
    stuck = Api(cut.base_url, api_key(cut.env, stuck_name, credits=100), stuck_name)
    other = Api(cut.base_url, api_key(cut.env, other_name, credits=10_000), other_name)
    caller, answered = _held_call(stuck, {"toolset": "demo", "tool": "sleep", "arguments": {"ms": 1000}})
    with _account_held(cut, stuck_name) as holder, _LockWaitsSeen(cut, holder) as waits:
        waits.until(lambda: any(stuck_name in w.users for w in waits.seen.values()), "the stuck call's finish never waited")
        before = set(waits.seen)  # its first try, batched with no other call

        def retries() -> list[_Wait]:  # those found waiting twice or more
            return [w for x, w in list(waits.seen.items()) if x not in before and stuck_name in w.users and w.last > w.first]

        records = _calls_until(other, lambda: len(retries()) >= 8)
        with psycopg.connect(cut.env["DATABASE_URL"]) as conn:
            (status,) = conn.execute(
                "SELECT status FROM execution_toolcall c JOIN auth_user u ON u.id = c.user_id WHERE u.username = %s", [stuck_name]
            ).fetchone() or (None,)
        seen = dict(waits.seen)
        waited = retries()
    caller.join(60)
    assert not caller.is_alive()
    assert status == "executing"  # the other user's calls all completed while it waited on the lock
    answers = [answer.json() for answer in answered]
    assert answers and answers[0]["status"] == "completed", answers
    assert records and all(record.get("status") == "completed" for record in records), [
        r for r in records if r.get("status") != "completed"
    ][:3]
    # No statement that waited on the lock was the other user's calls' too, and while most of its
    # retries waited, other calls were finished (before: each retry's batch held up the others, or
    # was theirs too).
    assert not [w.users for w in seen.values() if other_name in w.users], seen
    went_on = _went_on_during(cut, other_name, "finished_at", waited)
    # Most: a wait is BRIEF_LOCK_WAIT_MS (0.2 s), and a loaded machine may finish none of their calls in one.
    assert sum(1 for n in went_on if n) > len(went_on) / 2, (went_on, waited)
    _check_ledger(cut)


CLAIMED = "import time\nfrom ptc_tools.demo import Demo\ntime.sleep(2)\nDemo.echo(value=7)"


@contextmanager
def _user_held_as_claimed(stack: Stack) -> Iterator[tuple[Api, dict, Api]]:
    """A user's running job, its call made while a stuck transaction holds the user's row locked
    (its claim's foreign key check waits on it), and another user: yield them while the lock is
    held, its call's claim waiting on it."""
    stuck_name, other_name = f"claimed-{uuid.uuid4().hex[:8]}", f"others-{uuid.uuid4().hex[:8]}"
    stuck = Api(stack.base_url, api_key(stack.env, stuck_name), stuck_name)
    other = Api(stack.base_url, api_key(stack.env, other_name, credits=10_000), other_name)
    job = stuck.post("/api/v1/exec", json={"code": CLAIMED, "toolsets": ["demo"], "wait": 0}).json()
    deadline = time.monotonic() + 30
    while stuck.get(f"/api/v1/exec/{job['id']}").json()["status"] != "running":
        assert time.monotonic() < deadline, "the job never ran"
        time.sleep(0.05)
    with psycopg.connect(stack.env["DATABASE_URL"]) as holder:
        holder.execute("SELECT 1 FROM auth_user WHERE username = %s FOR UPDATE", [stuck_name])
        time.sleep(3)  # its call's claim has begun waiting
        yield stuck, job, other


def _user_holder(conn: psycopg.Connection) -> int:
    """The pid of the backend that holds a user's row locked (``_user_held_as_claimed``'s)."""
    (holder,) = conn.execute(
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND state = 'idle in transaction' "
        "AND query LIKE 'SELECT 1 FROM auth_user WHERE username = %FOR UPDATE'"
    ).fetchone()
    return holder


def _ended(api: Api, job: dict, seconds: float = 60) -> dict:
    """``job`` as it ended, waited for up to ``seconds``."""
    deadline = time.monotonic() + seconds
    while (final := api.get(f"/api/v1/exec/{job['id']}").json())["status"] in ("queued", "running"):
        assert time.monotonic() < deadline, "the job did not end"
        time.sleep(0.2)
    return final


def test_a_claim_waiting_on_a_locked_user_holds_up_no_other_users_calls(cut: Stack) -> None:
    """A job's call is claimed by writing its record, whose foreign keys (Django's are DEFERRABLE
    INITIALLY DEFERRED) are checked at the commit: the one to its user waits on the user's row
    while a stuck transaction holds it locked (FOR UPDATE, as the quota check of a request takes it).
    PostgreSQL runs that check past the statement's clock: statement_timeout never cancelled it, and
    the tools worker's claims, a batch at a time, all waited behind it, any user's, for as long as
    the lock was held (here another user's calls timed out). With lock_timeout set too, it is
    cancelled, its task tries again until the lock goes, and the job then ends with the call's
    result; the other user's calls go on, held up by none of its retries, which claim it alone: none
    of the three that wait on the lock while those calls go on is their claims' transaction too
    (before, in the worker's batches, each was, and held every other claim up for a timeout)."""
    with _user_held_as_claimed(cut) as (stuck, job, other), psycopg.connect(cut.env["DATABASE_URL"], autocommit=True) as conn:
        with _LockWaitsSeen(cut, _user_holder(conn)) as waits:
            waits.until(lambda: bool(waits.seen), "the call's claim never waited on its user's row")
            before = set(waits.seen)  # its first tries, before the other user's calls

            def retries() -> list[_Wait]:  # those found waiting twice or more
                return [w for x, w in list(waits.seen.items()) if x not in before and w.last > w.first]

            records = _calls_until(other, lambda: len(retries()) >= 3)
            running = stuck.get(f"/api/v1/exec/{job['id']}").json()
            seen = dict(waits.seen)
            waited = retries()
    final = _ended(stuck, job)
    assert (final["status"], final["return_value"]) == ("completed", 7), (final["error"], final["stderr"][-2000:])
    # The other user's calls all completed while its claim waited, the job still running.
    assert (running["status"], running["tool_calls"]) == ("running", [])
    assert records and all(record.get("status") == "completed" for record in records)
    # No transaction that waited on the lock claimed the other user's calls too, and while each of its
    # retries waited, other calls were claimed (before: each retry's batch held up the others, or was
    # theirs too).
    assert not [w.users for w in seen.values() if other.username in w.users], seen
    went_on = _went_on_during(cut, other.username, "claimed_at", waited)
    assert all(went_on), (went_on, waited)  # a wait is the statement timeout (1 s)


def test_a_call_whose_tool_lookup_is_cancelled_after_its_claim_runs_at_its_tasks_retry(cut: Stack) -> None:
    """A job's call is claimed, then its tools worker's look-up of its tool waits on the toolsets'
    table, held locked by a stuck transaction past the statement timeout, and is cancelled: the
    claim committed, the tool not run. Its task's retry takes that claim over and runs the call once,
    and the job ends with its result. Before, the retry found the call claimed under a fresh lease
    and dropped it as a duplicate; a lease later the reaper failed it worker_lost (no worker had
    died), and the job with it."""
    logged = cut.tools_worker.log.stat().st_size
    with psycopg.connect(cut.env["DATABASE_URL"], autocommit=True) as conn, psycopg.connect(cut.env["DATABASE_URL"]) as toolsets:
        with _user_held_as_claimed(cut) as (stuck, job, _):
            # Its claim waits on the user's row: the table is held from before the claim commits.
            toolsets.execute("LOCK TABLE tools_toolset IN ACCESS EXCLUSIVE MODE")
        deadline = time.monotonic() + 30
        claimed = "SELECT 1 FROM execution_toolcall WHERE exec_job_id = %s AND claimed_at IS NOT NULL"
        while conn.execute(claimed, [job["id"]]).fetchone() is None:
            assert time.monotonic() < deadline, "the call was never claimed"
            time.sleep(0.05)
        time.sleep(2)  # its tool's look-up, waiting on the table, cancelled (1 s)
        toolsets.rollback()
        final = _ended(stuck, job)
        assert (final["status"], final["return_value"]) == ("completed", 7), (final["error"], final["stderr"][-2000:])
        calls = conn.execute("SELECT status, output FROM execution_toolcall WHERE exec_job_id = %s", [job["id"]]).fetchall()
    assert calls == [("completed", 7)]
    with cut.tools_worker.log.open("rb") as log:
        log.seek(logged)
        assert b"a claimed call's tool could not be looked up" in log.read()  # where the database failed


def _row_copy(conn: psycopg.Connection, table: str, where: tuple[str, str], **values: str) -> None:
    """Write a copy of the row of ``table`` where ``where`` (column, value) is, with ``values`` (SQL
    expressions, by column): as a job or call of a worker that died, or a queue message lost."""
    sets = ", ".join(f"{column} = {expression}" for column, expression in values.items())
    conn.execute(f"CREATE TEMP TABLE copied AS SELECT * FROM {table} WHERE {where[0]} = %s", [where[1]])
    conn.execute(f"UPDATE copied SET {sets}")
    conn.execute(f"INSERT INTO {table} SELECT * FROM copied")
    conn.execute("DROP TABLE copied")


def _job_copy(conn: psycopg.Connection, job_id: str, **values: str) -> str:
    """Write a copy of job ``job_id`` with a new id and call_id and ``values``; return its id."""
    new = str(uuid.uuid4())
    _row_copy(conn, "execution_execjob", ("id", job_id), id=f"'{new}'", call_id=f"'exec_{uuid.uuid4().hex}'", **values)
    return new


def _open_call_copy(conn: psycopg.Connection, call_id: str, new: str, **values: str) -> None:
    """Write a copy of call ``call_id``, open (executing, no output), as call ``new``, with
    ``values`` (SQL expressions, by column)."""
    _row_copy(
        conn,
        "execution_toolcall",
        ("call_id", call_id),
        id="nextval(pg_get_serial_sequence('execution_toolcall', 'id'))",
        call_id=f"'{new}'",
        status="'executing'",
        finished_at="NULL",
        output="NULL",
        **values,
    )


def test_a_job_row_held_locked_past_the_statement_timeout_holds_up_only_that_job_in_the_reapers_round(cut: Stack) -> None:
    """A job lost in the queue (past PTC_QUEUED_MAX_SECONDS) whose row a stuck transaction holds
    locked: the reaper's statement failing it is cancelled at the timeout. Only that job waits for
    the lock: a job whose worker died is still failed WorkerLost at the reaper's next rounds, and
    the locked one once the lock goes. Before, the cancel ended every round there, and the reaper
    failed no job after it, of any user, for as long as the lock was held."""
    username = f"reaper-{uuid.uuid4().hex[:8]}"
    api = Api(cut.base_url, api_key(cut.env, username), username)
    done = api.run("1")
    assert done["status"] == "completed", done
    with psycopg.connect(cut.env["DATABASE_URL"], autocommit=True) as conn:
        lost = _job_copy(conn, done["id"], status="'queued'", created_at="now() - interval '2 hours'", started_at="NULL")
        dead = _job_copy(conn, done["id"], status="'running'", heartbeat_at="now() - interval '1 hour'", closed_at="NULL")
        conn.execute("UPDATE execution_execjob SET finished_at = NULL WHERE id IN (%s, %s)", [lost, dead])
    with psycopg.connect(cut.env["DATABASE_URL"]) as holder:
        holder.execute("SELECT 1 FROM execution_execjob WHERE id = %s FOR UPDATE", [lost])
        deadline = time.monotonic() + 15
        while (dead_job := api.get(f"/api/v1/exec/{dead}").json())["status"] == "running":
            assert time.monotonic() < deadline, "the job whose worker died was not reaped while another job's row was locked"
            time.sleep(0.2)
        assert api.get(f"/api/v1/exec/{lost}").json()["status"] == "queued"
    assert (dead_job["status"], dead_job["error"]["type"]) == ("failed", "WorkerLost"), dead_job
    deadline = time.monotonic() + 15
    while (lost_job := api.get(f"/api/v1/exec/{lost}").json())["status"] == "queued":
        assert time.monotonic() < deadline, "the lost job was not failed once its row's lock went"
        time.sleep(0.2)
    assert (lost_job["status"], lost_job["error"]["type"]) == ("failed", "WorkerLost"), lost_job
    assert "no exec worker took the job" in lost_job["error"]["message"]


def test_a_standalone_call_whose_hold_is_cancelled_is_failed_and_frees_its_place_in_the_quota(cut: Stack) -> None:
    """POST /tools/execute records the call, then holds its price: with the account's row held locked
    past the statement timeout, the hold is cancelled and the answer is 503 database_unavailable,
    try again. The call was not run: its record says so (failed, nothing held or charged), and it
    no longer counts in the user's quota of calls in flight, so the retry the 503 asks for runs.
    Before, the record stayed executing, unclaimed, until the reaper abandoned it (twice the tool
    timeout later), and at a quota of 1 the retry was 429 rate_limited."""
    username = f"hold-{uuid.uuid4().hex[:8]}"
    api = Api(cut.base_url, api_key(cut.env, username, credits=100), username)
    with psycopg.connect(cut.env["DATABASE_URL"], autocommit=True) as conn:
        conn.execute(
            "INSERT INTO accounts_usersettings (user_id, max_concurrent_tool_calls) SELECT id, 1 FROM auth_user WHERE username = %s",
            [username],
        )
    body = {"toolset": "demo", "tool": "add", "arguments": {"a": 1, "b": 2}}
    with psycopg.connect(cut.env["DATABASE_URL"]) as holder:
        holder.execute(
            "SELECT 1 FROM billing_creditaccount a JOIN auth_user u ON u.id = a.user_id WHERE u.username = %s FOR UPDATE OF a",
            [username],
        )
        cancelled = api.post("/api/v1/tools/execute", json=body)
    assert cancelled.status_code == 503, cancelled.text
    assert cancelled.json()["error"]["code"] == "database_unavailable"
    with psycopg.connect(cut.env["DATABASE_URL"]) as conn:
        (status, code, credits), *others = conn.execute(
            "SELECT c.status, c.error->>'code', c.credits FROM execution_toolcall c JOIN auth_user u ON u.id = c.user_id "
            "WHERE u.username = %s",
            [username],
        ).fetchall()
    assert (others, status, code, credits) == ([], "failed", "database_unavailable", 0)
    again = api.post("/api/v1/tools/execute", json=body)
    assert again.status_code == 200 and again.json()["status"] == "completed", again.text
    assert api.get("/api/v1/billing/balance").json()["balance"] == 99
    _check_ledger(cut)


def test_a_containers_call_that_ran_is_answered_though_its_jobs_row_is_held_locked_as_it_ends(cut: Stack) -> None:
    """A managed container's call adds its result's size to its job's row once it has run. With that
    row held locked past the statement timeout (by a transaction that updated it and is stuck), that
    statement is cancelled: the call has run and is charged, so its answer is still its record (200
    completed), not 503 "try again", whose retry ran the tool, and charged it, a second time. The
    job's bytes keep the room held for the result."""
    username = f"container-{uuid.uuid4().hex[:8]}"
    api = Api(cut.base_url, api_key(cut.env, username, credits=100), username)
    caller = {"type": "code_execution_20260120", "tool_id": "srvtoolu_1"}
    container = f"container_{uuid.uuid4().hex[:12]}"
    body = {"toolset": "demo", "tool": "echo", "arguments": {"value": 1}, "caller": caller, "container_id": container}
    first = api.post("/api/v1/tools/execute", json=body)
    assert first.status_code == 200 and first.json()["status"] == "completed", first.text
    job_call_id = first.json()["ptc_call_id"]
    before = api.get("/api/v1/billing/balance").json()["balance"]
    caller_thread, answers = _held_call(api, {**body, "tool": "sleep", "arguments": {"ms": 1500}})
    # As a transaction that updated the job's row and is stuck holds it: the call's own updates of
    # its row (its lease, its finish) take a key-share lock on the job's, which this lets through.
    with psycopg.connect(cut.env["DATABASE_URL"]) as holder:
        holder.execute("SELECT 1 FROM execution_execjob WHERE call_id = %s FOR NO KEY UPDATE", [job_call_id])
        caller_thread.join(5)
    caller_thread.join(30)
    assert not caller_thread.is_alive()
    (answer,) = answers
    assert answer.status_code == 200, answer.text
    assert (answer.json()["status"], answer.json()["output"], answer.json()["credits"]) == ("completed", {"slept_ms": 1500}, 1)
    assert api.get("/api/v1/billing/balance").json()["balance"] == before - 1  # charged once
    _check_ledger(cut)


def test_a_jobs_claim_cancelled_by_the_statement_timeout_runs_the_job_once_the_lock_goes(cut: Stack) -> None:
    """A queued job whose row a stuck transaction holds locked: the exec worker's claim is cancelled
    at the timeout, again at each of run_exec's retries, and once the lock goes the job is claimed
    and runs once, its call charged once, and the worker serves the next job. (This held before; it
    was untested end to end.)"""
    username = f"claim-{uuid.uuid4().hex[:8]}"
    api = Api(cut.base_url, api_key(cut.env, username, credits=100), username)
    code = "from ptc_tools.demo import Demo\nprint('ran')\nDemo.add(a=1, b=2)"
    logged = cut.exec_worker.log.stat().st_size
    cut.exec_worker.stop()
    try:
        job = api.post("/api/v1/exec", json={"code": code, "toolsets": ["demo"], "wait": 0}).json()
        assert job["status"] == "queued", job
        with psycopg.connect(cut.env["DATABASE_URL"]) as holder:
            holder.execute("SELECT 1 FROM execution_execjob WHERE id = %s FOR UPDATE", [job["id"]])
            cut.exec_worker.start()
            time.sleep(5)  # the claim and its retries cancelled meanwhile
            assert api.get(f"/api/v1/exec/{job['id']}").json()["status"] == "queued"
    finally:
        if cut.exec_worker.proc is None or cut.exec_worker.proc.poll() is not None:
            cut.exec_worker.start()
    deadline = time.monotonic() + 30
    while (final := api.get(f"/api/v1/exec/{job['id']}").json())["status"] in ("queued", "running"):
        assert time.monotonic() < deadline, "the job did not run once its row's lock went"
        time.sleep(0.2)
    assert (final["status"], final["return_value"], final["stdout"]) == ("completed", 3, "ran\n"), final
    assert final["credits_charged"] == 1
    assert api.get("/api/v1/billing/balance").json()["balance"] == 99
    assert api.run("6 * 7")["return_value"] == 42
    with cut.exec_worker.log.open("rb") as log:
        log.seek(logged)
        assert b"canceling statement due to statement timeout" in log.read()  # the claim was cancelled, and retried


def test_a_running_jobs_row_held_locked_past_its_lease_is_not_reaped_before_its_worker_renews(cut: Stack) -> None:
    """A running job whose row a stuck transaction holds locked: its worker's lease renewals wait on
    the lock and are cancelled, as the reaper's statement failing it is, so its lease lapses though
    its worker lives. Once the lock goes, the reaper gives its worker a lease to renew before it
    judges the job. Before, its next round failed the job WorkerLost (the worker's renewal here comes
    1.5 s after the lock went, the reaper's round every second)."""
    username = f"renew-{uuid.uuid4().hex[:8]}"
    api = Api(cut.base_url, api_key(cut.env, username), username)
    done = api.run("1")
    with psycopg.connect(cut.env["DATABASE_URL"], autocommit=True) as conn:
        live = _job_copy(conn, done["id"], status="'running'", heartbeat_at="now() - interval '10 seconds'", closed_at="NULL")
        conn.execute("UPDATE execution_execjob SET finished_at = NULL WHERE id = %s", [live])
        with psycopg.connect(cut.env["DATABASE_URL"]) as holder:
            holder.execute("SELECT 1 FROM execution_execjob WHERE id = %s FOR UPDATE", [live])
            time.sleep(3)  # the reaper's rounds find it locked
        time.sleep(1.5)
        renewed = conn.execute(
            "UPDATE execution_execjob SET heartbeat_at = now() WHERE id = %s AND status = 'running'", [live]
        ).rowcount  # as its worker's next renewal
        status = api.get(f"/api/v1/exec/{live}").json()
        conn.execute("UPDATE execution_execjob SET status = 'cancelled', finished_at = now() WHERE id = %s", [live])
    assert renewed == 1, status["error"]


def test_a_running_calls_row_held_locked_past_its_lease_is_not_reaped_before_its_worker_renews(cut: Stack) -> None:
    """A call a tools worker runs, whose row a stuck transaction holds locked: the worker's lease
    renewals wait on the lock and are cancelled, as the reaper's statement failing it is, so its
    lease lapses though its worker lives. Once the lock goes, the reaper gives the worker a lease
    to renew before it judges the call. Before, its next round failed the call worker_lost (the
    renewal here comes 1.5 s after the lock went, the reaper's round every second)."""
    username = f"lease-{uuid.uuid4().hex[:8]}"
    api = Api(cut.base_url, api_key(cut.env, username), username)
    done = api.post("/api/v1/tools/execute", json={"toolset": "demo", "tool": "echo", "arguments": {"value": 1}}).json()
    live = f"standalone_{uuid.uuid4().hex}"
    with psycopg.connect(cut.env["DATABASE_URL"], autocommit=True) as conn:
        _open_call_copy(
            conn, done["call_id"], live, claimed_at="now() - interval '1 minute'", heartbeat_at="now() - interval '10 seconds'"
        )
        with psycopg.connect(cut.env["DATABASE_URL"]) as holder:
            holder.execute("SELECT 1 FROM execution_toolcall WHERE call_id = %s FOR UPDATE", [live])
            time.sleep(5)  # the reaper's rounds (every second) find it locked, a loaded machine's too
        time.sleep(1.5)
        renewed = conn.execute(
            "UPDATE execution_toolcall SET heartbeat_at = now() WHERE call_id = %s AND status = 'executing'", [live]
        ).rowcount  # as its worker's next renewal
        error = conn.execute("SELECT error FROM execution_toolcall WHERE call_id = %s", [live]).fetchone()
        conn.execute("UPDATE execution_toolcall SET status = 'failed', finished_at = now() WHERE call_id = %s", [live])
    assert renewed == 1, error


def test_a_jobs_lease_renewal_cancelled_on_its_locked_row_is_logged_as_such_and_the_job_goes_on(cut: Stack) -> None:
    """A running job whose row is held locked for a while: its worker's lease renewals are
    cancelled, the job goes on and ends as it would, and the worker's log says why the renewal
    failed: its row held locked, not "the database is unreachable" (an operator then looks for an
    outage that is not there, as db_retry's line said before c0adf5a)."""
    username = f"logged-{uuid.uuid4().hex[:8]}"
    api = Api(cut.base_url, api_key(cut.env, username), username)
    logged = cut.exec_worker.log.stat().st_size
    job = api.post("/api/v1/exec", json={"code": "import time\ntime.sleep(4)\n6 * 7", "wait": 0}).json()
    deadline = time.monotonic() + 20
    while api.get(f"/api/v1/exec/{job['id']}").json()["status"] != "running":
        assert time.monotonic() < deadline, "the job never ran"
        time.sleep(0.05)
    with psycopg.connect(cut.env["DATABASE_URL"]) as holder:
        holder.execute("SELECT 1 FROM execution_execjob WHERE id = %s FOR NO KEY UPDATE", [job["id"]])
        time.sleep(2.5)  # under the lease (4 s): two renewals cancelled
    deadline = time.monotonic() + 20
    while (final := api.get(f"/api/v1/exec/{job['id']}").json())["status"] in ("queued", "running"):
        assert time.monotonic() < deadline, "the job did not end"
        time.sleep(0.2)
    assert (final["status"], final["return_value"]) == ("completed", 42), final["error"]
    with cut.exec_worker.log.open("rb") as log:
        log.seek(logged)
        lines = [line for line in log.read().decode().splitlines() if "could not renew the job's lease" in line]
    assert lines and all("held locked" in line for line in lines), lines


def test_a_jobs_claim_cancelled_past_the_queued_bound_is_not_retried_and_the_job_fails(cut: Stack) -> None:
    """A job queued past PTC_QUEUED_MAX_SECONDS whose row a stuck transaction holds locked: its exec
    worker's claim is cancelled, and not tried again (the job is failed, or, its row still locked,
    left to the reaper), and once the lock goes the job ends failed WorkerLost, never run. Before,
    run_exec retried the claim a timeout and a backoff apart for as many tries as the bound has 5 s
    (hours, at a 30 s timeout), and a try after the lock went could run a job queued for hours."""
    username = f"bound-{uuid.uuid4().hex[:8]}"
    api = Api(cut.base_url, api_key(cut.env, username, credits=100), username)
    logged = cut.exec_worker.log.stat().st_size
    cut.exec_worker.stop()
    try:
        job = api.post("/api/v1/exec", json={"code": "print('ran')", "wait": 0}).json()
        assert job["status"] == "queued", job
        with psycopg.connect(cut.env["DATABASE_URL"], autocommit=True) as conn:
            conn.execute("UPDATE execution_execjob SET created_at = now() - interval '2 hours' WHERE id = %s", [job["id"]])
        with psycopg.connect(cut.env["DATABASE_URL"]) as holder:
            holder.execute("SELECT 1 FROM execution_execjob WHERE id = %s FOR UPDATE", [job["id"]])
            cut.exec_worker.start()
            deadline = time.monotonic() + 30
            while not any(line in cut.exec_worker.log.read_bytes()[logged:] for line in (b"is not retried", b"retry: Retry in")):
                assert time.monotonic() < deadline, "the worker's claim was neither retried nor given up"
                time.sleep(0.2)
            time.sleep(4)  # the time for a retry or two, were there any
            assert api.get(f"/api/v1/exec/{job['id']}").json()["status"] == "queued"
            log = cut.exec_worker.log.read_bytes()[logged:]
            assert b"retry: Retry in" not in log, log.decode(errors="replace")[-3000:]
    finally:
        if cut.exec_worker.proc is None or cut.exec_worker.proc.poll() is not None:
            cut.exec_worker.start()
    deadline = time.monotonic() + 30
    while (final := api.get(f"/api/v1/exec/{job['id']}").json())["status"] in ("queued", "running"):
        assert time.monotonic() < deadline, "the job did not end once its row's lock went"
        time.sleep(0.2)
    assert (final["status"], final["error"]["type"], final["started_at"], final["stdout"]) == ("failed", "WorkerLost", None, "")
    assert b"retry: Retry in" not in cut.exec_worker.log.read_bytes()[logged:]


def test_a_sessions_row_held_locked_past_its_lease_is_not_reaped_before_its_worker_renews(cut: Stack) -> None:
    """A session an exec worker holds, whose row a stuck transaction holds locked: the worker's
    renewals skip it, so its lease lapses though its worker lives. Once the lock goes, the reaper
    gives the worker a lease to renew before it judges the session, as for a job or a call. Before,
    its next round ended the session lost, its sandbox killed (the renewal here comes 1.5 s after the
    lock went, the reaper's round every second)."""
    username = f"session-{uuid.uuid4().hex[:8]}"
    api = Api(cut.base_url, api_key(cut.env, username), username)
    session = api.post("/api/v1/sessions", json={"toolsets": ["demo"]}).json()
    assert api.run("1", session=session["id"])["status"] == "completed"  # held by the worker, which renews it
    live = str(uuid.uuid4())
    with psycopg.connect(cut.env["DATABASE_URL"], autocommit=True) as conn:
        _row_copy(
            conn, "execution_execsession", ("id", session["id"]), id=f"'{live}'", heartbeat_at="now() - interval '10 seconds'"
        )
        with psycopg.connect(cut.env["DATABASE_URL"]) as holder:
            holder.execute("SELECT 1 FROM execution_execsession WHERE id = %s FOR UPDATE", [live])
            time.sleep(5)  # the reaper's rounds (every second) find it locked, a loaded machine's too
        time.sleep(1.5)
        renewed = conn.execute(
            "UPDATE execution_execsession SET heartbeat_at = now() WHERE id = %s AND status = 'active'", [live]
        ).rowcount  # as its worker's next renewal
        reason = conn.execute("SELECT end_reason FROM execution_execsession WHERE id = %s", [live]).fetchone()
        conn.execute("UPDATE execution_execsession SET status = 'deleted', ended_at = now() WHERE id = %s", [live])
    assert renewed == 1, reason
