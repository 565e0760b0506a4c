"""Anthropic's managed programmatic tool calling, both ways: our toolsets exported as tools its
container may call (``allowed_callers``), and its calls executed here through POST /tools/execute
with ``caller`` and ``container_id``: recorded as ``ptc`` calls under one job per container, billed,
streamed, in the timeline. The official ``anthropic`` SDK talks to a local fake of the Messages API."""

import json
import uuid
from collections.abc import Callable
from typing import Any

import anthropic
import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from tests.conftest import Api
from tests.execution.client_loop import sse_events
from tests.execution.fake_messages_api import FakeMessagesApi


def managed_context(api: Api, **body: Any) -> dict[str, Any]:
    response = api.post("/api/v1/ptc/context", json={"toolsets": ["demo"], "format": "anthropic-managed", **body})
    assert response.status_code == 200, response.text
    return response.json()


def test_the_export_names_the_code_execution_versions_that_may_call(api: Api) -> None:
    context = managed_context(api)
    code_execution, *tools = context["tools"]
    assert code_execution == {"type": "code_execution_20250825", "name": "code_execution"}
    by_name = {tool["name"]: tool for tool in tools}
    assert by_name["add"]["allowed_callers"] == ["code_execution_20250825"]
    assert by_name["add"]["input_schema"]["required"] == ["a", "b"]
    assert "exec_code" not in by_name
    assert context["routes"]["add"] == {"toolset": "demo", "tool": "add"}
    newer = managed_context(api, code_execution_version="code_execution_20260120")
    assert newer["tools"][0]["type"] == "code_execution_20260120"
    assert {tuple(t.get("allowed_callers", [])) for t in newer["tools"][1:]} == {("code_execution_20260120",)}
    bad = api.post("/api/v1/ptc/context", json={"format": "anthropic-managed", "code_execution_version": "code_execution_1999"})
    assert bad.status_code == 400


def run_managed_loop(api: Api, fake: FakeMessagesApi, context: dict[str, Any]) -> tuple[Any, list[dict[str, Any]]]:
    """The team's agent loop: the SDK against the fake; each tool_use the container makes is run
    through our API and its tool_result sent back, in the same container. Return the last message
    and our ToolCalls."""
    client = anthropic.Anthropic(api_key="sk-test-not-real", base_url=fake.url, max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is 2 + 3? Use code."}]
    response = client.messages.create(model="claude-test", max_tokens=1024, tools=context["tools"], messages=messages)
    calls = []
    while response.stop_reason == "tool_use":
        assert response.container is not None
        results = []
        for block in response.content:
            if block.type != "tool_use" or block.caller is None or block.caller.type == "direct":
                continue
            route = context["routes"][block.name]
            executed = api.post(
                "/api/v1/tools/execute",
                json={
                    **route,
                    "arguments": block.input,
                    "caller": {"type": block.caller.type, "tool_id": block.caller.tool_id},
                    "container_id": response.container.id,
                },
            )
            assert executed.status_code == 200, executed.text
            call = executed.json()
            calls.append(call)
            ok = call["status"] == "completed"
            results.append(
                {
                    "type": "tool_result",
                    "tool_use_id": block.id,
                    "content": json.dumps(call["output"]) if ok else call["error"]["message"],
                    "is_error": not ok,
                }
            )
        messages += [
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in response.content]},
            {"role": "user", "content": results},
        ]
        response = client.messages.create(
            model="claude-test", max_tokens=1024, tools=context["tools"], messages=messages, container=response.container.id
        )
    return response, calls


def test_the_official_sdk_loop_runs_a_container_call_through_our_api(make_api: Callable[..., Api]) -> None:
    api = make_api(credits=50)
    context = managed_context(api)
    with FakeMessagesApi(tool="add", arguments={"a": 2, "b": 3}) as fake:
        final, calls = run_managed_loop(api, fake, context)
    assert final.stop_reason == "end_turn"
    assert final.content[0].text == "The answer is 5"
    first, second = fake.requests
    assert {"name": "add"}.items() <= next(t for t in first["body"]["tools"] if t["name"] == "add").items()
    assert next(t for t in first["body"]["tools"] if t["name"] == "add")["allowed_callers"] == ["code_execution_20250825"]
    assert second["body"]["container"] == fake.container
    assert second["body"]["messages"][-1]["content"][0] == {
        "type": "tool_result",
        "tool_use_id": fake.tool_use,
        "content": "5",
        "is_error": False,
    }
    # Ours: a ptc call under the container's job, with its caller, billed and streamed.
    [call] = calls
    assert call["type"] == "ptc" and call["status"] == "completed" and call["output"] == 5 and call["credits"] == 1
    assert call["caller"] == {"type": "code_execution_20250825", "tool_id": fake.server_tool_use}
    jobs = [j for j in api.get("/api/v1/exec").json()["results"] if j["container_id"] == fake.container]
    [job] = jobs
    assert job["status"] == "running" and job["call_id"] == call["ptc_call_id"]
    assert [c["call_id"] for c in job["tool_calls"]] == [call["call_id"]]
    assert job["credits_charged"] == 1
    assert api.get("/api/v1/billing/balance").json()["balance"] == 49


def test_one_job_per_container_and_user_and_a_cancelled_container_takes_no_more_calls(make_api: Callable[..., Api]) -> None:
    owner, other = make_api(), make_api()
    container = f"container_{uuid.uuid4().hex[:12]}"
    caller = {"type": "code_execution_20260120", "tool_id": "srvtoolu_1"}
    body = {"toolset": "demo", "tool": "echo", "arguments": {"value": "hi"}, "caller": caller, "container_id": container}
    first = owner.post("/api/v1/tools/execute", json=body).json()
    second = owner.post("/api/v1/tools/execute", json={**body, "arguments": {"value": "again"}}).json()
    theirs = other.post("/api/v1/tools/execute", json=body).json()
    assert first["ptc_call_id"] == second["ptc_call_id"] != theirs["ptc_call_id"]
    [job] = [j for j in owner.get("/api/v1/exec").json()["results"] if j["container_id"] == container]
    assert [c["output"] for c in job["tool_calls"]] == ["hi", "again"]
    # The container's job is in the timeline like any job's (read in-process: the page only reads).
    admin = Client()
    admin.force_login(
        get_user_model().objects.create_user(username=f"a-{uuid.uuid4().hex[:6]}", is_staff=True, is_superuser=True)
    )
    page = admin.get(f"/admin/execution/execjob/{job['id']}/change/").content.decode()
    assert page.count('class="ptc-tl-bar ptc-completed"') == 2 and f"managed container {container}" in page
    assert other.get(f"/api/v1/exec/{job['id']}").status_code == 404
    cancelled = owner.post(f"/api/v1/exec/{job['id']}/cancel")
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    events = [name for name, _ in sse_events(owner, job["id"], timeout=15)]
    assert events.count("tool_call_end") == 2 and events[-1] == "exec_end"
    refused = owner.post("/api/v1/tools/execute", json=body)
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "job_finished"
    no_caller = owner.post("/api/v1/tools/execute", json={k: v for k, v in body.items() if k != "caller"})
    assert no_caller.status_code == 400


@pytest.mark.parametrize("container_id", ["has space", "x" * 201, ""])
def test_a_bad_container_id_is_400(api: Api, container_id: str) -> None:
    body = {"toolset": "demo", "tool": "echo", "arguments": {"value": 1}, "container_id": container_id}
    response = api.post("/api/v1/tools/execute", json={**body, "caller": {"type": "code_execution_20250825", "tool_id": "s"}})
    assert response.status_code == 400


@pytest.mark.parametrize(
    ("toolset", "tool", "code"),
    [("nope", "echo", "unknown_toolset"), ("demo", "nope", "unknown_tool"), ("client", "echo", "unknown_toolset")],
)
def test_a_container_call_refused_as_it_is_checked_makes_no_job(api: Api, toolset: str, tool: str, code: str) -> None:
    """A call its request names no such toolset or tool for is refused before anything is written:
    not a running job for a container that has made no call (one never reaped), nor its start."""
    container = f"container_{uuid.uuid4().hex[:12]}"
    caller = {"type": "code_execution_20250825", "tool_id": "srvtoolu_1"}
    body = {"toolset": toolset, "tool": tool, "arguments": {"value": 1}, "caller": caller, "container_id": container}
    refused = api.post("/api/v1/tools/execute", json=body)
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["code"] == code
    assert [j for j in api.get("/api/v1/exec").json()["results"] if j["container_id"] == container] == []
    # Its first call that is checked makes the job, which then has that one call.
    made = api.post("/api/v1/tools/execute", json={**body, "toolset": "demo", "tool": "echo"})
    assert made.status_code == 200 and made.json()["output"] == 1, made.text
    [job] = [j for j in api.get("/api/v1/exec").json()["results"] if j["container_id"] == container]
    assert [c["call_id"] for c in job["tool_calls"]] == [made.json()["call_id"]]
