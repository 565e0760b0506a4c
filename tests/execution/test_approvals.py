"""Approvals: a call of a tool (or toolset) marked requires_approval, or of any tool that is not
read_only when the policy says approval_for_writes, waits as awaiting_approval until staff or the
job's owner approve it (it runs) or deny it (ToolError code "denied"). Real workers, real HTTP."""

import time
from collections.abc import Callable, Iterator
from contextlib import closing
from typing import Any

import pytest
import redis
from django.db import connection, transaction
from django.utils import timezone

from execution.backplane import RedisBackplane
from tests.conftest import REDIS_URL, Api, own_deployment
from tests.execution.client_loop import ClientLoop, sse_events
from tests.execution.rival import rival_answer
from tests.servers import api_key
from tests.stack import free_port
from tests.tools.conftest import unique_key
from tests.tools.http_api import HttpApi
from tools.sdk import class_name


@pytest.fixture(scope="module")
def http_api() -> Iterator[HttpApi]:
    with HttpApi(expected_key="unused") as server:
        yield server


def shop(staff: Api, http_api: HttpApi, *, toolset_approval: bool = False, tool_approval: bool = True) -> str:
    """An http toolset: ``look`` (read-only), ``buy`` (side effects; requires_approval unless told not)."""
    key = unique_key("shop")
    city = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    body = {
        "key": key,
        "name": "Shop",
        "kind": "http",
        "requires_approval": toolset_approval,
        "config": {"base_url": http_api.url, "timeout": 10},
        "tools": [
            {
                "name": "look",
                "input_schema": city,
                "read_only": True,
                "http": {"method": "GET", "path": "/forecast/{city}", "query": []},
            },
            {
                "name": "buy",
                "input_schema": city,
                "requires_approval": tool_approval,
                "http": {"method": "POST", "path": "/items/{city}", "query": []},
            },
        ],
    }
    response = staff.post("/api/v1/toolsets", json=body)
    assert response.status_code == 201, response.text
    assert response.json()["requires_approval"] is toolset_approval
    return key


def submit(api: Api, code: str, toolsets: list[str], **body: Any) -> dict[str, Any]:
    response = api.post("/api/v1/exec", json={"code": code, "toolsets": toolsets, "wait": 0, **body})
    assert response.status_code == 201, response.text
    return response.json()


def pending(api: Api, job_id: str, count: int = 1) -> list[dict[str, Any]]:
    found = []
    with closing(sse_events(api, job_id)) as events:  # closed here, not when collected
        for event, data in events:
            if event == "tool_call_pending":
                found.append(data)
                if len(found) == count:
                    return found
    raise AssertionError(f"the job ended with {len(found)} pending calls, not {count}")


def finished(api: Api, job_id: str) -> dict[str, Any]:
    with closing(sse_events(api, job_id)) as events:  # closed here, not when collected
        for event, _ in events:
            if event == "exec_end":
                return api.get(f"/api/v1/exec/{job_id}").json()
    raise AssertionError("no exec_end")


def test_an_approved_call_runs_and_the_approval_is_audited(make_api: Callable[..., Api], staff: Api, http_api: HttpApi) -> None:
    key = shop(staff, http_api)
    owner, stranger = make_api(), make_api()
    job = submit(owner, f"from ptc_tools.{key} import {class_name(key)} as S\nS.look(city='a')\nS.buy(city='paris')", [key])
    [block] = pending(owner, job["id"])
    assert block["awaiting"] == "approval" and block["name"] == "buy" and block["input"] == {"city": "paris"}
    assert block["call"]["status"] == "awaiting_approval"
    url = f"/api/v1/tool-calls/{block['id']}/approval"
    assert stranger.post(url, json={"approve": True}).status_code == 404  # another user's call
    decided = owner.post(url, json={"approve": True, "reason": "fine"})
    assert decided.status_code == 200, decided.text
    assert decided.json()["decision"] == "approved" and decided.json()["decided_by"] == owner.username
    again = owner.post(url, json={"approve": False})
    assert again.status_code == 409 and again.json()["error"]["code"] == "decision_conflict"
    final = finished(owner, job["id"])
    assert final["status"] == "completed", final["error"]
    look, buy = final["tool_calls"]
    assert look["status"] == "completed" and look["decision"] == ""  # read-only: never waited
    assert buy["status"] == "completed" and buy["output"]["method"] == "POST"
    assert (buy["decision"], buy["decided_by"], buy["decision_reason"]) == ("approved", owner.username, "fine")
    assert buy["decided_at"] >= buy["started_at"]
    # Its approval is in the job's events, and in the history rebuilt from the records (it was not).
    for _ in range(2):
        names = [(event, data.get("call_id") or data.get("id")) for event, data in sse_events(owner, job["id"])]
        assert names.index(("tool_call_pending", buy["call_id"])) < names.index(("tool_call_approved", buy["call_id"]))
        assert names.index(("tool_call_approved", buy["call_id"])) < names.index(("tool_call_end", buy["call_id"]))
        redis.Redis.from_url(REDIS_URL).delete(RedisBackplane.stream_key(job["call_id"]))  # as if it had expired
    # Deciding a call that never waited: 409, nothing changes.
    never = owner.post(f"/api/v1/tool-calls/{look['call_id']}/approval", json={"approve": True})
    assert never.status_code == 409 and never.json()["error"]["code"] == "call_not_awaiting"


def test_a_denied_call_raises_tool_error_denied_and_staff_may_decide(
    make_api: Callable[..., Api], staff: Api, http_api: HttpApi
) -> None:
    key = shop(staff, http_api)
    owner = make_api()
    code = f"""
from ptc_tools import ToolError
from ptc_tools.{key} import {class_name(key)} as S
try:
    S.buy(city='x')
except ToolError as e:
    print(e.code, "|", e.message)
"""
    job = submit(owner, code, [key])
    [block] = pending(owner, job["id"])
    denied = staff.post(f"/api/v1/tool-calls/{block['id']}/approval", json={"approve": False, "reason": "too expensive"})
    assert denied.status_code == 200, denied.text
    final = finished(owner, job["id"])
    assert final["status"] == "completed", final["error"]
    assert final["stdout"].startswith("denied | the call was denied by ")
    assert "too expensive" in final["stdout"]
    [call] = final["tool_calls"]
    assert call["status"] == "failed" and call["error"]["code"] == "denied"
    assert (call["decision"], call["decided_by"]) == ("denied", staff.username)


@pytest.mark.parametrize("approve", [True, False])
def test_a_decision_after_its_jobs_end_is_refused_before_the_worker_closes_the_call(
    api: Api, staff: Api, http_api: HttpApi, approve: bool
) -> None:
    from execution.models import ExecJob, ToolCall

    key = shop(staff, http_api)
    job = submit(api, f"from ptc_tools.{key} import {class_name(key)} as S\nS.buy(city='x')", [key])
    [block] = pending(api, job["id"])
    # What a cancel writes first; the job's worker closes its calls at its next heartbeat.
    ExecJob.objects.filter(pk=job["id"]).update(status=ExecJob.Status.CANCELLED)
    late = api.post(f"/api/v1/tool-calls/{block['id']}/approval", json={"approve": approve})
    assert late.status_code == 409 and late.json()["error"]["code"] == "call_not_awaiting", late.text
    final = finished(api, job["id"])
    assert final["status"] == "cancelled"
    call = ToolCall.objects.get(call_id=block["id"])
    assert (call.decision, call.error["code"]) == ("", "job_ended")


@pytest.mark.parametrize("approve", [True, False])
def test_of_two_decisions_at_once_only_the_first_holds(api: Api, staff: Api, http_api: HttpApi, approve: bool) -> None:
    from execution.models import ToolCall

    key = shop(staff, http_api)
    job = submit(api, f"from ptc_tools.{key} import {class_name(key)} as S\nS.buy(city='x')", [key])
    [block] = pending(api, job["id"])
    url = f"/api/v1/tool-calls/{block['id']}/approval"
    # The rival decided the other way and has not committed: this decision waits for the call's row.
    rival = {"decision": ToolCall.Decision.DENIED if approve else ToolCall.Decision.APPROVED}
    rival["status"] = ToolCall.Status.FAILED if approve else ToolCall.Status.EXECUTING
    with rival_answer(block["id"], **rival) as send:
        second = send(lambda: api.post(url, json={"approve": approve}))
    assert second.result().status_code == 409, second.result().text
    assert second.result().json()["error"]["code"] == "decision_conflict"
    call = ToolCall.objects.get(call_id=block["id"])
    assert (call.status, call.decision, call.decided_by_id) == (rival["status"], rival["decision"], None)
    assert api.post(f"/api/v1/exec/{job['id']}/cancel").status_code == 200


def test_toolset_approval_and_the_policy_for_writes(make_api: Callable[..., Api], staff: Api, http_api: HttpApi) -> None:
    gated = shop(staff, http_api, toolset_approval=True, tool_approval=False)
    api = make_api()
    job = submit(api, f"from ptc_tools.{gated} import {class_name(gated)} as S\nS.look(city='a')", [gated])
    [block] = pending(api, job["id"])  # even the read-only tool: the whole toolset is gated
    assert block["name"] == "look"
    assert api.post(f"/api/v1/exec/{job['id']}/cancel").status_code == 200
    final = finished(api, job["id"])
    assert final["status"] == "cancelled"
    assert final["tool_calls"][0]["error"]["code"] == "job_ended"

    plain = shop(staff, http_api, tool_approval=False)
    assert staff.http.patch("/api/v1/policy", json={"approval_for_writes": True}).json()["approval_for_writes"] is True
    code = f"from ptc_tools.{plain} import {class_name(plain)} as S\nS.look(city='a')\nS.buy(city='b')"
    job = submit(api, code, [plain])
    with ClientLoop(api, job["id"], lambda name, args: None, approver=lambda block: {"approve": True}) as loop:
        pass
    assert not loop.errors, loop.errors
    assert [b["name"] for b in loop.pending] == ["buy"]  # look is read_only: it ran at once
    final = api.get(f"/api/v1/exec/{job['id']}").json()
    assert final["status"] == "completed", final["error"]
    assert [c["decision"] for c in final["tool_calls"]] == ["", "approved"]


def test_a_program_mixing_a_server_a_client_and_a_gated_tool(make_api: Callable[..., Api], staff: Api, http_api: HttpApi) -> None:
    """Done when: a server tool, a client tool and an approval-gated tool, end to end through the API."""
    key = shop(staff, http_api)
    api = make_api(credits=100)
    code = f"""
from ptc_tools.client import Client
from ptc_tools.demo import Demo
from ptc_tools.{key} import {class_name(key)} as S
total = Demo.add(a=2, b=3)
ok = Client.confirm(question=f"buy for {{total}}?")
bought = S.buy(city="paris") if ok else None
print(total, ok, bought["method"])
"""
    confirm = {"name": "confirm", "input_schema": {"type": "object", "properties": {"question": {"type": "string"}}}}
    job = submit(api, code, ["demo", key], client_tools=[confirm])
    with ClientLoop(
        api, job["id"], lambda name, args: {"content": args["question"] == "buy for 5?"}, approver=lambda b: {"approve": True}
    ) as loop:
        pass
    assert not loop.errors, loop.errors
    final = api.get(f"/api/v1/exec/{job['id']}").json()
    assert final["status"] == "completed", final["error"]
    assert final["stdout"] == "5 True POST\n"
    statuses = [(c["toolset"], c["tool"], c["status"], c["decision"]) for c in final["tool_calls"]]
    assert statuses == [
        ("demo", "add", "completed", ""),
        ("client", "confirm", "completed", ""),
        (key, "buy", "completed", "approved"),
    ]
    assert [b["awaiting"] for b in loop.pending] == ["client", "approval"]
    assert "tool_call_approved" in loop.events


def test_tools_execute_refuses_a_gated_tool_rather_than_skip_its_approval(
    make_api: Callable[..., Api], staff: Api, http_api: HttpApi
) -> None:
    key = shop(staff, http_api)
    api = make_api()
    gated = api.post("/api/v1/tools/execute", json={"toolset": key, "tool": "buy", "arguments": {"city": "x"}})
    assert gated.status_code == 403 and gated.json()["error"]["code"] == "approval_required"
    free = api.post("/api/v1/tools/execute", json={"toolset": key, "tool": "look", "arguments": {"city": "x"}})
    assert free.status_code == 200 and free.json()["status"] == "completed"
    calls = api.get("/api/v1/tool-calls").json()["results"]
    assert [c["tool"] for c in calls] == ["look"]  # the refused one left no record


def test_a_job_that_ends_before_its_approved_call_is_taken_fails_it_and_gives_its_price_back_at_once(
    make_api: Callable[..., Api], staff: Api, http_api: HttpApi
) -> None:
    from billing.models import Reservation

    key = shop(staff, http_api)
    # No worker of the test stack serves tools.slow: the approved call waits there, recorded, unclaimed.
    routed = staff.http.patch(f"/api/v1/toolsets/{key}", json={"queue": "tools.slow", "price": 5})
    assert routed.status_code == 200, routed.text
    owner = make_api()
    job = submit(owner, f"from ptc_tools.{key} import {class_name(key)} as S\nS.buy(city='paris')", [key])
    [block] = pending(owner, job["id"])
    assert owner.post(f"/api/v1/tool-calls/{block['id']}/approval", json={"approve": True}).status_code == 200
    assert owner.post(f"/api/v1/exec/{job['id']}/cancel").status_code == 200
    final = finished(owner, job["id"])
    [buy] = final["tool_calls"]
    assert buy["status"] == "failed" and buy["error"]["code"] == "job_ended"
    # Released by the job's close, before its end is announced: not a lease later by the reaper.
    assert Reservation.objects.get(tool_call_id=block["id"]).status == "released"


def test_a_call_approved_late_is_not_reaped_as_stuck_while_its_tool_runs(stack_env: dict[str, str]) -> None:
    # The reaper fails a claimed call as stuck once it is older than any tool may run
    # (PTC_TIMEOUT_CEILING and two leases), its worker alive or not. It measured from the call's
    # start, which for a gated call is when it began to wait: one approved after a long wait was
    # failed worker_lost as it ran, its result dropped and its price given back though it ran.
    with own_deployment(stack_env, "late-approval", PTC_TIMEOUT_CEILING="12") as stack:
        reviewer, owner = f"reviewer-{free_port()}", f"owner-{free_port()}"
        staff = Api(stack.base_url, api_key(stack.env, reviewer, staff=True), reviewer)
        api = Api(stack.base_url, api_key(stack.env, owner), owner)
        gated = staff.http.patch("/api/v1/toolsets/demo", json={"requires_approval": True})
        assert gated.status_code == 200, gated.text
        job = submit(api, "from ptc_tools.demo import Demo\nDemo.sleep(ms=9000)", ["demo"])
        [block] = pending(api, job["id"])
        time.sleep(14)  # the job's clock stands still while the call waits
        decided = api.post(f"/api/v1/tool-calls/{block['id']}/approval", json={"approve": True})
        assert decided.status_code == 200, decided.text
        # Past 12 + 2 * 4 s from the call's start the tool still runs (until 14 + 9 s): its worker is alive.
        final = finished(api, job["id"])
        assert final["status"] == "completed", final["error"]
        assert final["return_value"] == {"slept_ms": 9000}
        [call] = final["tool_calls"]
        assert (call["status"], call["credits"]) == ("completed", 1)


def _blocked_query_starts(prefix: str) -> bool:
    """Whether a statement starting with ``prefix`` waits for a lock this session holds."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_clear_snapshot()")
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE pg_backend_pid() = ANY(pg_blocking_pids(pid)) AND query LIKE %s",
            [prefix + "%"],
        )
        return bool(cursor.fetchone()[0])


def test_a_reaper_that_finds_a_held_call_completed_meanwhile_leaves_its_credits_as_charged(
    api: Api, staff: Api, http_api: HttpApi, stack_env: dict[str, str]
) -> None:
    # The reapers settle what a dead worker left held: they list the prices held past a lease, then
    # ask how each call ended. A call that completed in between (answered, approved and run) was
    # settled by its finish already; the reaper's settle then charged nothing and wrote that 0 on
    # the call, over the credits its finish recorded: the account was charged 5, the call and the
    # job's credits_charged said 0.
    from billing.models import CreditUsage
    from billing.services import credits_settle
    from execution.models import ToolCall

    key = shop(staff, http_api)
    priced = staff.http.patch(f"/api/v1/toolsets/{key}", json={"price": 5})
    assert priced.status_code == 200, priced.text
    job = submit(api, f"from ptc_tools.{key} import {class_name(key)} as S\nS.buy(city='x')", [key])
    [block] = pending(api, job["id"])
    time.sleep(float(stack_env["PTC_JOB_LEASE_SECONDS"]) + 1)  # its price held past a lease: each reaper round looks at it
    status_read = f'SELECT "{ToolCall._meta.db_table}"."status"'
    with transaction.atomic():
        with connection.cursor() as cursor:  # the stack's reapers (every second) stop at their read of the call
            cursor.execute(f"LOCK TABLE {ToolCall._meta.db_table} IN ACCESS EXCLUSIVE MODE")
        deadline = time.monotonic() + 15
        while not _blocked_query_starts(status_read):
            assert time.monotonic() < deadline, "no reaper came to read the call"
            time.sleep(0.05)
        # Meanwhile the call completes, as a finish writes it: recorded with what was held, settled.
        done = {"status": ToolCall.Status.COMPLETED, "output": "bought", "credits": 5, "claimed_at": timezone.now()}
        assert ToolCall.objects.filter(call_id=block["id"]).update(**done, finished_at=timezone.now()) == 1
        assert credits_settle(tool_call_id=block["id"]) == 5
    time.sleep(2)  # the reapers read it completed, and go on
    assert CreditUsage.objects.get(tool_call_id=block["id"]).amount == 5
    assert ToolCall.objects.get(call_id=block["id"]).credits == 5
    assert api.post(f"/api/v1/exec/{job['id']}/cancel").status_code == 200
    assert finished(api, job["id"])["credits_charged"] == 5
