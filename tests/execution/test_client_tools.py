"""Client tools: tools the job's caller runs. The code blocks on them; a real client loop reads the
SSE stream and answers through POST /api/v1/exec/{id}/tool-results. Real workers, real HTTP."""

import json
import socket
import time
import uuid
from collections.abc import Callable
from contextlib import closing
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from tests.conftest import Api
from tests.execution.client_loop import ClientLoop, sse_events
from tests.execution.rival import rival_answer

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city, from the user's own device.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    "output_schema": {"type": "object", "properties": {"temp": {"type": "number"}}},
}


def tool(name: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "input_schema": {"type": "object", "properties": {"n": {"type": "integer"}}}, **extra}


def submit(api: Api, code: str, client_tools: list[dict[str, Any]], **body: Any) -> dict[str, Any]:
    response = api.post(
        "/api/v1/exec", json={"code": code, "toolsets": ["demo"], "client_tools": client_tools, "wait": 0, **body}
    )
    assert response.status_code == 201, response.text
    return response.json()


def finished(api: Api, job_id: str, seconds: float = 60) -> dict[str, Any]:
    """The job once it has ended (the stream's exec_end is what the loop waited for)."""
    with closing(sse_events(api, job_id, timeout=seconds)) as events:  # closed here, not when collected
        for event, _data in events:
            if event == "exec_end":
                return api.get(f"/api/v1/exec/{job_id}").json()
    raise AssertionError("the stream ended without exec_end")


def first_pending(api: Api, job_id: str) -> dict[str, Any]:
    with closing(sse_events(api, job_id)) as events:  # closed here, not when collected
        for event, data in events:
            if event == "tool_call_pending":
                return data
    raise AssertionError("the job ended without a pending call")


def test_a_client_tool_round_trip_with_a_server_tool(api: Api) -> None:
    code = """
from ptc_tools.client import Client
from ptc_tools.demo import Demo
w = Client.get_weather(city="Paris")
print("got", w)
Demo.add(a=w["temp"], b=1)
"""
    job = submit(api, code, [WEATHER])
    with ClientLoop(api, job["id"], lambda name, args: {"content": {"temp": 20 if args["city"] == "Paris" else 0}}) as loop:
        pass
    assert not loop.errors, loop.errors
    final = api.get(f"/api/v1/exec/{job['id']}").json()
    assert final["status"] == "completed", final["error"]
    assert final["return_value"] == 21
    assert final["stdout"] == "got {'temp': 20}\n"
    assert final["client_tools"][0]["name"] == "get_weather"
    [block] = loop.pending
    client_call, server_call = final["tool_calls"]
    assert block == {
        "type": "tool_use",
        "id": client_call["call_id"],
        "name": "get_weather",
        "input": {"city": "Paris"},
        "caller": {"type": "code_execution", "tool_id": job["call_id"]},
        "awaiting": "client",
        "toolset": "client",
        "call": {**block["call"], "status": "awaiting_client"},
    }
    assert (client_call["toolset"], client_call["status"], client_call["output"]) == ("client", "completed", {"temp": 20})
    assert client_call["credits"] == 0  # a job's own client tools are free
    assert (server_call["tool"], server_call["status"], server_call["credits"]) == ("add", "completed", 1)
    [(status, answered)] = loop.answers
    assert status == 200 and answered[0]["status"] == "completed"
    assert loop.events.count("tool_call_end") == 2
    # It is in the SDK the job ran: same module, documented.
    sdk = final["sdk_hash"]
    assert sdk and len(sdk) == 64


def test_client_calls_stay_parallel(api: Api) -> None:
    code = """
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from ptc_tools.client import Client
with ThreadPoolExecutor(3) as pool:
    out = list(pool.map(lambda i: Client.double(n=i), [1, 2, 3]))
out
"""
    job = submit(api, code, [tool("double")])
    # The loop answers only once all three are pending at the same time, in one POST.
    with ClientLoop(api, job["id"], lambda name, args: {"content": args["n"] * 2}, batch=3) as loop:
        pass
    assert not loop.errors, loop.errors
    final = api.get(f"/api/v1/exec/{job['id']}").json()
    assert final["status"] == "completed", final["error"]
    assert final["return_value"] == [2, 4, 6]
    assert len(loop.pending) == 3 and len(loop.answers) == 1


def test_text_blocks_and_errors_reach_the_code(api: Api) -> None:
    code = """
from ptc_tools import ToolError
from ptc_tools.client import Client
text = Client.read(n=1)
try:
    Client.read(n=2)
except ToolError as e:
    print(e.code, e.message)
text
"""

    def handler(name: str, args: dict[str, Any]) -> dict[str, Any]:
        if args["n"] == 1:
            return {"content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "world"}]}
        return {"content": "no such file", "is_error": True}

    job = submit(api, code, [tool("read")])
    with ClientLoop(api, job["id"], handler) as loop:
        pass
    assert not loop.errors, loop.errors
    final = api.get(f"/api/v1/exec/{job['id']}").json()
    assert final["status"] == "completed", final["error"]
    assert final["return_value"] == "hello world"
    assert final["stdout"] == "client_error no such file\n"
    assert final["tool_calls"][1]["error"] == {"code": "client_error", "message": "no such file"}


def test_an_unanswered_call_times_out_and_a_late_answer_is_refused(api: Api) -> None:
    code = """
from ptc_tools import ToolError
from ptc_tools.client import Client
try:
    Client.slow(n=1)
except ToolError as e:
    print(e.code)
"""
    job = submit(api, code, [tool("slow", timeout=1)])
    final = finished(api, job["id"])
    assert final["status"] == "completed", final["error"]
    assert final["stdout"] == "tool_timeout\n"
    [call] = final["tool_calls"]
    assert call["status"] == "failed" and call["error"]["code"] == "tool_timeout"
    late = api.post(f"/api/v1/exec/{job['id']}/tool-results", json=[{"tool_use_id": call["call_id"], "content": 1}])
    assert late.status_code == 409
    assert late.json()["error"]["code"] == "call_not_awaiting"


def test_a_second_answer_is_409_and_changes_nothing(api: Api) -> None:
    job = submit(api, "from ptc_tools.client import Client\nClient.once(n=1)", [tool("once")])
    block = first_pending(api, job["id"])
    url = f"/api/v1/exec/{job['id']}/tool-results"
    # Content that can't be stored as given is refused, not changed: the call still waits.
    for content in ("a\u0000b", {"k\u0000": 1}, ["\ud800"]):
        body = json.dumps([{"tool_use_id": block["id"], "content": content}])  # escaped: a lone surrogate is no UTF-8
        unfit = api.post(url, content=body, headers={"Content-Type": "application/json"})
        assert unfit.status_code == 400, unfit.text
        if content == ["\ud800"]:  # no body of text holds one: refused as the body is read
            assert unfit.json()["error"]["code"] == "parse_error" and "lone surrogate" in unfit.json()["error"]["message"]
        else:
            assert unfit.json()["error"]["code"] == "validation_error" and "can't be stored" in unfit.json()["error"]["message"]
    first = api.post(url, json=[{"tool_use_id": block["id"], "content": "first"}])
    assert first.status_code == 200, first.text
    second = api.post(url, json=[{"tool_use_id": block["id"], "content": "second"}])
    assert second.status_code == 409
    assert second.json()["error"]["code"] == "result_conflict"
    final = finished(api, job["id"])
    assert final["return_value"] == "first"
    assert final["tool_calls"][0]["output"] == "first"


def test_wrong_user_unknown_and_foreign_calls(make_api: Callable[..., Api]) -> None:
    owner, stranger = make_api(), make_api()
    code = "from ptc_tools.client import Client\nfrom ptc_tools.demo import Demo\nDemo.add(a=1, b=1)\nClient.x(n=1)"
    job = submit(owner, code, [tool("x")])
    other = submit(owner, "from ptc_tools.client import Client\nClient.x(n=2)", [tool("x")])
    block = first_pending(owner, job["id"])
    other_block = first_pending(owner, other["id"])
    url = f"/api/v1/exec/{job['id']}/tool-results"
    # Another user's job: 404, as if it did not exist.
    refused = stranger.post(url, json=[{"tool_use_id": block["id"], "content": 1}])
    assert refused.status_code == 404 and refused.json()["error"]["code"] == "not_found"
    unknown = owner.post(url, json=[{"tool_use_id": "ptc_nope", "content": 1}])
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "call_not_found"
    foreign = owner.post(url, json=[{"tool_use_id": other_block["id"], "content": 1}])
    assert foreign.status_code == 404 and foreign.json()["error"]["code"] == "call_not_found"
    server_call = owner.get(f"/api/v1/exec/{job['id']}").json()["tool_calls"][0]
    assert server_call["tool"] == "add"
    not_client = owner.post(url, json=[{"tool_use_id": server_call["call_id"], "content": 1}])
    assert not_client.status_code == 409 and not_client.json()["error"]["code"] == "call_not_awaiting"
    # A batch with one bad id records none of it.
    mixed = owner.post(url, json=[{"tool_use_id": block["id"], "content": 1}, {"tool_use_id": "ptc_nope", "content": 1}])
    assert mixed.status_code == 404
    assert owner.get(f"/api/v1/exec/{job['id']}").json()["tool_calls"][1]["status"] == "awaiting_client"
    bad = owner.post(url, json={"tool_use_id": block["id"]})
    assert bad.status_code == 400
    huge = owner.post(url, json=[{"tool_use_id": block["id"], "content": "x" * (1024 * 1024 + 1)}])
    assert huge.status_code == 400 and huge.json()["error"]["code"] == "validation_error"
    twice = owner.post(url, json=[{"tool_use_id": block["id"], "content": 1}, {"tool_use_id": block["id"], "content": 2}])
    assert twice.status_code == 400
    many = owner.post(url, json=[{"tool_use_id": f"ptc_{i}", "content": i} for i in range(1025)])
    assert many.status_code == 400 and many.json()["error"]["code"] == "validation_error"
    for job_id in (job["id"], other["id"]):
        assert owner.post(f"/api/v1/exec/{job_id}/cancel").status_code == 200


def test_cancel_while_waiting_ends_the_job_and_fails_the_call(api: Api) -> None:
    job = submit(api, "from ptc_tools.client import Client\nClient.wait(n=1)", [tool("wait")])
    block = first_pending(api, job["id"])
    cancelled = api.post(f"/api/v1/exec/{job['id']}/cancel")
    assert cancelled.status_code == 200
    final = finished(api, job["id"])
    assert final["status"] == "cancelled"
    [call] = final["tool_calls"]
    assert call["status"] == "failed" and call["error"]["code"] == "job_ended"
    late = api.post(f"/api/v1/exec/{job['id']}/tool-results", json=[{"tool_use_id": block["id"], "content": 1}])
    assert late.status_code == 409


def test_an_answer_after_its_jobs_end_is_refused_before_the_worker_closes_the_call(api: Api) -> None:
    from execution.models import ExecJob, ToolCall

    job = submit(api, "from ptc_tools.client import Client\nClient.wait(n=1)", [tool("wait")])
    block = first_pending(api, job["id"])
    # What a cancel writes first; the job's worker closes its calls a moment later (at its next
    # heartbeat here, no Cancel pushed). An answer in between must not land on the ended job.
    ExecJob.objects.filter(pk=job["id"]).update(status=ExecJob.Status.CANCELLED)
    late = api.post(f"/api/v1/exec/{job['id']}/tool-results", json=[{"tool_use_id": block["id"], "content": 1}])
    assert late.status_code == 409 and late.json()["error"]["code"] == "call_not_awaiting", late.text
    assert "job has ended" in late.json()["error"]["message"]
    final = finished(api, job["id"])
    assert final["status"] == "cancelled"
    assert ToolCall.objects.get(call_id=block["id"]).error["code"] == "job_ended"


def test_of_two_answers_at_once_only_the_first_holds(api: Api) -> None:
    from django.utils import timezone

    from execution.models import ToolCall

    job = submit(api, "from ptc_tools.client import Client\nprint(Client.wait(n=1))", [tool("wait")])
    block = first_pending(api, job["id"])
    # The rival answer has made its UPDATE and not committed: this one waits for the call's row.
    with rival_answer(block["id"], status=ToolCall.Status.COMPLETED, output="first", claimed_at=timezone.now()) as send:
        second = send(
            lambda: api.post(f"/api/v1/exec/{job['id']}/tool-results", json=[{"tool_use_id": block["id"], "content": "second"}])
        )
    assert second.result().status_code == 409, second.result().text
    assert second.result().json()["error"]["code"] == "result_conflict"
    assert ToolCall.objects.get(call_id=block["id"]).output == "first"
    assert api.post(f"/api/v1/exec/{job['id']}/cancel").status_code == 200


def _slow_answer(seconds: float) -> Callable[[str, dict[str, Any]], dict[str, Any]]:
    def answer(name: str, args: dict[str, Any]) -> dict[str, Any]:
        time.sleep(seconds)
        return {"content": "late"}

    return answer


def test_waiting_on_the_client_does_not_count_against_the_timeout(api: Api, staff: Api) -> None:
    assert staff.http.patch("/api/v1/policy", json={"max_client_wait": 60}).status_code == 200
    code = "from ptc_tools.client import Client\nClient.think(n=1)"
    job = submit(api, code, [tool("think")], timeout=2)
    with ClientLoop(api, job["id"], _slow_answer(3.5)) as loop:
        pass
    assert not loop.errors, loop.errors
    final = api.get(f"/api/v1/exec/{job['id']}").json()
    assert final["status"] == "completed", final["error"]
    assert final["return_value"] == "late"
    assert final["execution_time_seconds"] > 3


def test_waiting_counts_past_max_client_wait(api: Api, staff: Api) -> None:
    assert staff.get("/api/v1/policy").json()["max_client_wait"] >= 0
    patched = staff.http.patch("/api/v1/policy", json={"max_client_wait": 1})
    assert patched.status_code == 200 and patched.json()["max_client_wait"] == 1
    job = submit(api, "from ptc_tools.client import Client\nClient.think(n=1)", [tool("think")], timeout=2)
    final = finished(api, job["id"])  # nobody answers: 2 s of run + 1 s of credited wait, then the end
    assert final["status"] == "timeout"
    assert 2.5 < final["execution_time_seconds"] < 15
    assert final["tool_calls"][0]["error"]["code"] == "job_ended"


@pytest.mark.parametrize(
    ("client_tools", "field"),
    [
        ([{"name": "not-python"}], "client_tools[0].name"),
        ([{"name": "x", "input_schema": {"type": "array"}}], "client_tools[0].input_schema"),
        ([{"name": "x", "input_schema": {"type": 5}}], "client_tools[0].input_schema"),
        (
            [{"name": "x", "input_schema": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}}],
            "client_tools[0].input_schema",
        ),
        ([{"name": "x"}, {"name": "x"}], "client_tools[1].name"),
        ([{"name": f"t{i}"} for i in range(65)], "client_tools"),
        ([{"name": "x", "description": "d" * 9000} for _ in range(40)], "client_tools"),
    ],
)
def test_bad_client_tools_are_400_and_nothing_is_created(api: Api, client_tools: list[dict[str, Any]], field: str) -> None:
    before = api.get("/api/v1/exec").json()["count"]
    response = api.post("/api/v1/exec", json={"code": "1", "toolsets": ["demo"], "client_tools": client_tools})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "validation_error"
    assert any(key.startswith(field) for key in response.json()["error"]["details"]), response.json()
    assert api.get("/api/v1/exec").json()["count"] == before


@pytest.mark.parametrize("path", ["/api/v1/exec", "/api/v1/ptc/context"])
def test_client_tools_over_their_limits_are_refused_for_that_before_each_is_checked(api: Api, path: str) -> None:
    # Every definition's name and schema were checked even past PTC_MAX_CLIENT_TOOLS (64): 10,000
    # of them in a 1 MB body held the web process 3 s per request, for an answer the count gave.
    tools = [tool(f"t{i}") for i in range(10_000)] + [tool("not-python")]
    body = {"toolsets": ["demo"], "client_tools": tools, **({"code": "1"} if path == "/api/v1/exec" else {})}
    started = time.monotonic()
    response = api.post(path, json=body)
    assert response.status_code == 400, response.text
    details = response.json()["error"]["details"]
    assert list(details) == ["client_tools"]  # the count and the size, not the last one's name
    assert details["client_tools"][0] == "at most 64 client tools per job"
    assert time.monotonic() - started < 2.5


def test_a_client_tools_pattern_that_backtracks_without_end_fails_its_call_not_the_worker(api: Api) -> None:
    # The schema's pattern is checked in the exec worker: matched by re, this held its GIL (every
    # job on it) for hours; now it gives up within 0.1 s and the call fails.
    evil = {"type": "object", "properties": {"s": {"type": "string", "pattern": "^(a|aa)+$"}}, "required": ["s"]}
    code = "from ptc_tools import ToolError\nfrom ptc_tools.client import Client\ntry:\n    got = Client.f(s='a' * 60 + '!')\nexcept ToolError as e:\n    got = e.code\ngot"
    started = time.monotonic()
    job = api.run(code, toolsets=["demo"], client_tools=[{"name": "f", "input_schema": evil}], timeout=10)
    assert (job["status"], job["return_value"]) == ("completed", "invalid_arguments"), job["error"]
    assert time.monotonic() - started < 8
    assert api.run("1 + 1", toolsets=["demo"])["return_value"] == 2


def test_a_client_tools_ref_to_a_url_is_never_fetched_by_the_worker(api: Api) -> None:
    # jsonschema fetched a $ref it did not hold with urlopen, no timeout, from the exec worker that
    # checks the call: any user's job made the worker GET any URL (its network, a cloud's metadata
    # address), and one that never answered held the job's bridge until the job was lost.
    with socket.create_server(("127.0.0.1", 0)) as listener:  # connections wait in its backlog, unanswered
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/schema.json"
        remote = {"type": "object", "properties": {"s": {"$ref": url}}, "required": ["s"]}
        code = "from ptc_tools import ToolError\nfrom ptc_tools.client import Client\ntry:\n    got = Client.f(s='x')\nexcept ToolError as e:\n    got = e.message\ngot"
        job = api.run(code, toolsets=["demo"], client_tools=[{"name": "f", "input_schema": remote}], timeout=10)
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody connected
    assert job["status"] == "completed", job["error"]
    assert "has a $ref that names nothing" in job["return_value"] and url in job["return_value"]


def test_a_shared_client_toolset_waits_on_the_client_and_is_billed_when_priced(make_api: Callable[..., Api], staff: Api) -> None:
    key = f"ui_{uuid.uuid4().hex[:6]}"
    confirm = {
        "name": "confirm",
        "description": "Ask the user to confirm in the app.",
        "input_schema": {"type": "object", "properties": {"question": {"type": "string"}}, "required": ["question"]},
    }
    created = staff.post(
        "/api/v1/toolsets",
        json={"key": key, "name": "App UI", "kind": "client", "is_global": True, "price": 2, "tools": [confirm]},
    )
    assert created.status_code == 201, created.text
    try:
        assert created.json()["kind"] == "client"
        api = make_api(credits=100)
        cls = "".join(part.capitalize() for part in key.split("_"))
        context = api.post("/api/v1/ptc/context", json={"toolsets": [key], "client_tools": [WEATHER]}).json()
        exec_code = next(t for t in context["tools"] if t["name"] == "exec_code")
        assert f"from ptc_tools.{key} import {cls}" in exec_code["description"]
        assert "from ptc_tools.client import Client" in exec_code["description"]
        assert "get_weather(city: str)" in exec_code["description"]
        code = f"from ptc_tools.{key} import {cls}\n{cls}.confirm(question='ship it?')"
        response = api.post("/api/v1/exec", json={"code": code, "toolsets": [key], "wait": 0})
        assert response.status_code == 201, response.text
        job = response.json()
        with ClientLoop(
            api, job["id"], lambda name, args: {"content": name == "confirm" and args["question"] == "ship it?"}
        ) as loop:
            pass
        assert not loop.errors, loop.errors
        assert loop.pending[0]["toolset"] == key
        final = api.get(f"/api/v1/exec/{job['id']}").json()
        assert final["status"] == "completed", final["error"]
        assert final["return_value"] is True
        assert final["tool_calls"][0]["credits"] == 2
        assert api.get("/api/v1/billing/balance").json()["balance"] == 98
        again = api.post(
            f"/api/v1/exec/{job['id']}/tool-results", json=[{"tool_use_id": loop.pending[0]["id"], "content": False}]
        )
        assert again.status_code == 409 and again.json()["error"]["code"] == "result_conflict"
        # The timeline draws its whole span as waited on the client (read in-process: the page only reads).
        admin = Client()
        admin.force_login(
            get_user_model().objects.create_user(username=f"a-{uuid.uuid4().hex[:6]}", is_staff=True, is_superuser=True)
        )
        page = admin.get(f"/admin/execution/execjob/{job['id']}/change/").content.decode()
        assert 'class="ptc-tl-wait" style="width:100.0%"' in page
    finally:  # a global toolset: every later test's user would see it
        deleted = staff.http.delete(f"/api/v1/toolsets/{key}")
    assert deleted.status_code == 204, deleted.text


def test_a_pending_calls_own_record_is_read_back_as_it_was_when_it_waited(api: Api) -> None:
    """``tool_call_pending`` carries the call as it waits (``call``). The log keeps a large event
    without its large fields, filled in from the record as it is when read: when the call's other
    fields passed 1 KB without its input (a name of 128 letters JSON writes as \\u escapes, which a
    Python identifier may be), the whole ``call`` was left out, and a reader after the client's
    answer read a pending call that had completed, its output and all."""
    name = "\u5de5" * 128
    client_tool = {"name": name, "input_schema": {"type": "object", "properties": {"text": {"type": "string"}}}}
    job = submit(api, f"from ptc_tools.client import Client\nClient.{name}(text='y' * 10_000)", [client_tool])
    block = first_pending(api, job["id"])
    assert block["call"]["status"] == "awaiting_client", block["call"]
    answered = api.post(f"/api/v1/exec/{job['id']}/tool-results", json=[{"tool_use_id": block["id"], "content": "done"}])
    assert answered.status_code == 200, answered.text
    assert finished(api, job["id"])["status"] == "completed"
    with closing(sse_events(api, job["id"])) as events:
        [again] = [data for event, data in events if event == "tool_call_pending"]
    assert again == block, (again["call"]["status"], again["call"]["output"])
