"""A job's end, as announced (exec_end, the End its waiters get, a cancel's answer), is its last word:
the calls a tools worker was running when the job ended are in it as they ended, and charged."""

import threading
import time
import uuid
from typing import Any

from tests.conftest import Api
from tests.execution.client_loop import sse_events

SLEEP_MS = 3000
# Calls Demo.sleep (1 credit) and prints once the call is on its way: the job is ended while it runs.
CALLS_A_SLOW_TOOL = f"""
import threading
from ptc_tools.demo import Demo
t = threading.Thread(target=Demo.sleep, kwargs={{"ms": {SLEEP_MS}}})
t.start()
print("calling", flush=True)
t.join()
"""


def _running_call(api: Api, job_id: str) -> dict[str, Any]:
    """Wait until the job's one call is claimed by a tools worker (its record is written by the
    claim), and return the job."""
    deadline = time.monotonic() + 15
    while True:
        job = api.get(f"/api/v1/exec/{job_id}").json()
        if job["tool_calls"] and job["tool_calls"][0]["status"] == "executing":
            return job
        assert time.monotonic() < deadline, job
        time.sleep(0.05)


def _waiting(api: Api, code: str, **body: Any) -> tuple[threading.Thread, dict[str, Any]]:
    """Submit ``code`` on a thread with a wait of 30 s: its answer is the End pushed to the waiter."""
    answer: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: answer.update(api.run(code, toolsets=["demo"], wait=30, **body)))
    thread.start()
    return thread, answer


def _newest_job(api: Api) -> str:
    deadline = time.monotonic() + 15
    while not (jobs := api.get("/api/v1/exec").json()["results"]):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return str(jobs[0]["id"])


def _settled(api: Api, job_id: str) -> dict[str, Any]:
    """The job once its calls have all ended (they run at most SLEEP_MS): its record, as GET shows it."""
    deadline = time.monotonic() + SLEEP_MS / 1000 + 15
    while True:
        job = api.get(f"/api/v1/exec/{job_id}").json()
        if all(c["status"] != "executing" for c in job["tool_calls"]):
            return job
        assert time.monotonic() < deadline, job
        time.sleep(0.1)


def _charged(api: Api, job_id: str) -> int:
    """What the account was charged for the job's calls, by its usage rows (the ledger's charges)."""
    return sum(row["amount"] for row in api.get("/api/v1/billing/usage", params={"exec": job_id}).json()["results"])


def _as_announced(view: dict[str, Any]) -> tuple[str, list[tuple[str, str, int]], int]:
    return (
        view["status"],
        [(c["call_id"], c["status"], c["credits"]) for c in view["tool_calls"]],
        view["credits_charged"],
    )


def test_a_job_cancelled_while_a_call_runs_announces_that_call_as_it_ended_and_charged(api: Api) -> None:
    """A cancel's answer, exec_end and the End its waiter got showed the call a tools worker was
    running still executing and credits_charged 0, though the call then completed and was charged:
    only a later GET said so."""
    waiter, ended = _waiting(api, CALLS_A_SLOW_TOOL)
    job_id = _newest_job(api)
    _running_call(api, job_id)
    cancelled = api.post(f"/api/v1/exec/{job_id}/cancel")
    assert cancelled.status_code == 200, cancelled.text
    waiter.join(40)
    final = _settled(api, job_id)
    [call] = final["tool_calls"]
    assert (final["status"], call["status"], final["credits_charged"]) == ("cancelled", "completed", 1)
    assert _charged(api, job_id) == 1
    assert api.get("/api/v1/billing/balance").json()["balance"] == 10_000 - 1
    events = list(sse_events(api, job_id, timeout=15))
    # The stream closes after exec_end: the call's own end comes before it, not after.
    assert [name for name, _ in events if name.startswith(("tool_call", "exec_end"))][-2:] == ["tool_call_end", "exec_end"]
    assert _as_announced(events[-1][1]) == _as_announced(final), "exec_end"
    assert _as_announced(ended) == _as_announced(final), "the End its waiter got"
    assert _as_announced(cancelled.json()) == _as_announced(final), "the cancel's answer"


def test_a_job_that_times_out_while_a_call_runs_announces_that_call_as_it_ended_and_charged(api: Api) -> None:
    """A job whose timeout came while a tools worker ran its call announced its end (exec_end, its
    waiter's End) with the call executing and nothing charged; the call then completed and was charged."""
    waiter, ended = _waiting(api, CALLS_A_SLOW_TOOL, timeout=1)
    job_id = _newest_job(api)
    waiter.join(40)
    final = _settled(api, job_id)
    [call] = final["tool_calls"]
    assert (final["status"], call["status"], final["credits_charged"]) == ("timeout", "completed", 1)
    assert _charged(api, job_id) == 1
    [end] = [data for name, data in sse_events(api, job_id, timeout=15) if name == "exec_end"]
    assert _as_announced(end) == _as_announced(final), "exec_end"
    assert _as_announced(ended) == _as_announced(final), "the End its waiter got"


def test_a_job_ended_by_a_limit_while_a_call_runs_announces_that_call_as_it_ended_and_charged(api: Api) -> None:
    """A job that passed PTC_MAX_JOB_TOOL_BYTES (8 MiB on the test stack) while a tools worker ran
    another of its calls announced its end with that call executing and nothing charged for it."""
    code = f"""
import threading
from ptc_tools.demo import Demo
t = threading.Thread(target=Demo.sleep, kwargs={{"ms": {SLEEP_MS}}})
t.start()
big = "x" * 900_000
for _ in range(12):
    Demo.echo(value=big)
"""
    waiter, ended = _waiting(api, code)
    job_id = _newest_job(api)
    waiter.join(40)
    final = _settled(api, job_id)
    assert (final["status"], final["error"]["type"]) == ("failed", "ResourceLimit"), final["error"]
    [slept] = [c for c in final["tool_calls"] if c["tool"] == "sleep"]
    assert (slept["status"], slept["credits"], final["credits_charged"], _charged(api, job_id)) == ("completed", 1, 1, 1)
    [end] = [data for name, data in sse_events(api, job_id, timeout=15) if name == "exec_end"]
    assert _as_announced(end) == _as_announced(final), "exec_end"
    assert _as_announced(ended) == _as_announced(final), "the End its waiter got"


def test_a_managed_containers_job_cancelled_while_a_call_runs_announces_that_call_as_it_ended(api: Api) -> None:
    """Cancelling a managed container's job while its call ran answered, and announced, the call
    executing and nothing charged; the call then completed and was charged."""
    container = f"container_{uuid.uuid4().hex[:12]}"
    body = {"toolset": "demo", "tool": "sleep", "container_id": container}
    body["caller"] = {"type": "code_execution_20250825", "tool_id": "srvtoolu_1"}
    first = api.post("/api/v1/tools/execute", json={**body, "arguments": {"ms": 0}})
    assert first.status_code == 200, first.text
    answer: dict[str, Any] = {}
    call = threading.Thread(
        target=lambda: answer.update(api.post("/api/v1/tools/execute", json={**body, "arguments": {"ms": SLEEP_MS}}).json())
    )
    call.start()
    job_id = _newest_job(api)
    deadline = time.monotonic() + 15
    while len(api.get(f"/api/v1/exec/{job_id}").json()["tool_calls"]) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(0.5)  # claimed by a tools worker, and running
    cancelled = api.post(f"/api/v1/exec/{job_id}/cancel")
    assert cancelled.status_code == 200, cancelled.text
    call.join(40)
    final = _settled(api, job_id)
    assert [c["status"] for c in final["tool_calls"]] == ["completed", "completed"]
    assert (final["status"], final["credits_charged"], _charged(api, job_id)) == ("cancelled", 2, 2)
    assert answer["status"] == "completed"
    [end] = [data for name, data in sse_events(api, job_id, timeout=15) if name == "exec_end"]
    assert _as_announced(end) == _as_announced(final), "exec_end"
    assert _as_announced(cancelled.json()) == _as_announced(final), "the cancel's answer"
