"""A row held locked by a transaction stuck elsewhere, under a statement timeout long enough to tell
a wait for it from a slow machine (15 s): what must not wait on it (a tools worker's other calls,
the reaper's other rows) goes on within a few seconds, and what needs it ends once the lock goes.

The deployment is its own (its database, its queues). tests/execution/test_statement_cancelled.py
has the same at a 1 s timeout, where what is cancelled is tried again.
"""

import time
import uuid
from collections.abc import Iterator

import psycopg
import pytest

from tests.conftest import Api, own_deployment
from tests.execution.test_statement_cancelled import _account_held, _calls_for, _check_ledger, _held_call
from tests.servers import api_key
from tests.stack import Stack

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
    calls took 5 s and more)."""
    stuck_name, other_name = f"stuck-{uuid.uuid4().hex[:8]}", f"other-{uuid.uuid4().hex[:8]}"
    stuck = Api(slow_cut.base_url, api_key(slow_cut.env, stuck_name, credits=100), stuck_name)
    other = Api(slow_cut.base_url, api_key(slow_cut.env, other_name, credits=10_000), other_name)
    caller, answers = _held_call(stuck, {"toolset": "demo", "tool": "sleep", "arguments": {"ms": 1000}})
    with _account_held(slow_cut, stuck_name):
        time.sleep(1.5)  # the stuck call's finish has begun waiting
        took, records = _calls_for(other, 6)
        assert caller.is_alive()  # still waiting on the lock
    caller.join(60)
    assert not caller.is_alive()
    held_up = sorted(round(t, 2) for t in took if t > HELD_UP)
    assert not held_up, held_up
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
    claimed alone, the stuck one waiting there, and the job ends with the call's result once the lock
    goes. Before, its first try held its batch, and every claim of every user that came meanwhile,
    until the lock went (another user's calls took 5 s and more)."""
    stuck_name, other_name = f"claimed-{uuid.uuid4().hex[:8]}", f"others-{uuid.uuid4().hex[:8]}"
    stuck = Api(slow_cut.base_url, api_key(slow_cut.env, stuck_name), stuck_name)
    other = Api(slow_cut.base_url, api_key(slow_cut.env, other_name, credits=10_000), other_name)
    code = "import time\nfrom ptc_tools.demo import Demo\ntime.sleep(2)\nDemo.echo(value=7)"
    job = stuck.post("/api/v1/exec", json={"code": code, "toolsets": ["demo"], "wait": 0}).json()
    deadline = time.monotonic() + 30
    while stuck.get(f"/api/v1/exec/{job['id']}").json()["status"] != "running":
        assert time.monotonic() < deadline, "the job never ran"
        time.sleep(0.05)
    with psycopg.connect(slow_cut.env["DATABASE_URL"]) as holder:
        holder.execute("SELECT 1 FROM auth_user WHERE username = %s FOR UPDATE", [stuck_name])
        time.sleep(3)  # its call's claim has begun waiting
        took, records = _calls_for(other, 6)
        assert stuck.get(f"/api/v1/exec/{job['id']}").json()["tool_calls"] == []  # its call's claim still waits
    deadline = time.monotonic() + 60
    while (final := stuck.get(f"/api/v1/exec/{job['id']}").json())["status"] in ("queued", "running"):
        assert time.monotonic() < deadline, "the job did not end once its user's lock went"
        time.sleep(0.2)
    assert (final["status"], final["return_value"]) == ("completed", 7), (final["error"], final["stderr"][-2000:])
    assert records and all(record.get("status") == "completed" for record in records)
    held_up = sorted(round(t, 2) for t in took if t > HELD_UP)
    assert not held_up, held_up
