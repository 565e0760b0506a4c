"""POST /api/v1/tools/execute with a user key, and with a job-scoped key from inside a running job."""

import hashlib
import time
import uuid

import httpx
import pytest

from ptcproject.accounts.models import ApiKey
from tests.conftest import Api
from tools.models import Toolset


def execute(client: httpx.Client, body: dict, **headers: str) -> httpx.Response:
    return client.post("/api/v1/tools/execute", json=body, headers=headers)


def test_a_standalone_call_with_a_user_key(api: Api) -> None:
    response = execute(api.http, {"toolset": "demo", "tool": "add", "arguments": {"a": 2, "b": 3}})
    assert response.status_code == 200, response.text
    call = response.json()
    assert call["type"] == "standalone"
    assert call["call_id"].startswith("standalone_")
    assert (call["status"], call["output"], call["error"]) == ("completed", 5, None)
    assert call["ptc_call_id"] == ""
    listed = api.get("/api/v1/tool-calls").json()["results"]
    assert call["call_id"] in [c["call_id"] for c in listed]


def test_a_failed_tool_is_still_200(api: Api) -> None:
    failed = execute(api.http, {"toolset": "demo", "tool": "fail", "arguments": {"message": "nope"}})
    assert failed.status_code == 200
    assert failed.json()["status"] == "failed"
    assert failed.json()["error"] == {"code": "tool_failed", "message": "nope"}
    invalid = execute(api.http, {"toolset": "demo", "tool": "add", "arguments": {"a": "x"}})
    assert invalid.status_code == 200
    assert invalid.json()["error"]["code"] == "invalid_arguments"


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ({"toolset": "nope", "tool": "add"}, "unknown_toolset"),
        ({"toolset": "demo", "tool": "nope"}, "unknown_tool"),
        ({"tool": "add"}, "validation_error"),
    ],
)
def test_a_request_for_no_such_tool_is_400(api: Api, body: dict, code: str) -> None:
    response = execute(api.http, body)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == code


def test_a_standalone_call_of_a_client_tool_is_told_there_is_no_job_to_have_one(api: Api) -> None:
    """``client`` is the toolset of a job's client tools: a call with no job (or a container's) is not
    told to list them in its job's client_tools, which it has not got."""
    response = execute(api.http, {"toolset": "client", "tool": "lookup", "arguments": {}})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "unknown_toolset"
    assert error["message"] == (
        "There is no toolset 'client' to call here: a job's client tools are called from that job's code, and run by its client."
    )
    assert api.get("/api/v1/tool-calls").json()["count"] == 0


def test_a_user_key_with_a_jobs_call_id_is_refused_not_made_a_standalone_call(api: Api) -> None:
    """x-ptc-call-id says the call is a job's: only that job's own key may make one. A user's key
    sending it (its own running job's call_id, or one that is no job's) is 403 call_id_mismatch,
    nothing recorded; it was run as a standalone call, outside the job's toolsets and limits."""
    job = api.run(JOB, toolsets=["demo"], wait=0)
    try:
        _job_key(api, job["id"])  # the job runs, and has its key
        for call_id in (job["call_id"], f"exec_{uuid.uuid4().hex}"):
            refused = execute(
                api.http, {"toolset": "demo", "tool": "add", "arguments": {"a": 1, "b": 1}}, **{"x-ptc-call-id": call_id}
            )
            assert refused.status_code == 403, refused.text
            error = refused.json()["error"]
            assert error["code"] == "call_id_mismatch"
            assert error["message"].startswith("A user's key cannot make a job's call"), error
        # Nothing recorded: the job has its key's echo, and the user no standalone call.
        assert [c["tool"] for c in api.get("/api/v1/tool-calls").json()["results"]] == ["echo"]
        # Without the header the same key makes a standalone call, as before.
        alone = execute(api.http, {"toolset": "demo", "tool": "add", "arguments": {"a": 1, "b": 1}})
        assert (alone.status_code, alone.json()["type"]) == (200, "standalone"), alone.text
    finally:
        assert api.post(f"/api/v1/exec/{job['id']}/cancel").status_code == 200


JOB = """
import time
from ptc_tools import _runtime
from ptc_tools.demo import Demo
Demo.echo(value=_runtime.job_info["key"])  # hands the test this job's key through the call record
time.sleep(6)
"""


def _job_key(api: Api, job_id: str) -> str:
    deadline = time.monotonic() + 15
    while True:
        calls = api.get("/api/v1/tool-calls", params={"exec": job_id}).json()["results"]
        if calls:
            return calls[0]["input"]["value"]
        assert time.monotonic() < deadline
        time.sleep(0.05)


KEY_THEN_CODE = """
import time
from ptc_tools import _runtime
from ptc_tools.demo import Demo
Demo.echo(value=_runtime.job_info["key"])
time.sleep(4)  # the test calls with the job's key meanwhile
Demo.add(a=1, b=1)
"""


def test_calls_made_with_the_jobs_key_count_against_its_limit_in_its_sandbox(api: Api, staff: Api) -> None:
    assert staff.http.patch("/api/v1/policy", json={"max_tool_calls": 3}).status_code == 200
    job = api.run(KEY_THEN_CODE, toolsets=["demo"], wait=0)
    client = httpx.Client(base_url=api.http.base_url, headers={"Authorization": f"Bearer {_job_key(api, job['id'])}"})
    for _ in range(2):  # the echo and these two: the job's three
        call = execute(
            client, {"toolset": "demo", "tool": "add", "arguments": {"a": 1, "b": 1}}, **{"x-ptc-call-id": job["call_id"]}
        )
        assert (call.status_code, call.json()["status"]) == (200, "completed"), call.text
    deadline = time.monotonic() + 30
    while (final := api.get(f"/api/v1/exec/{job['id']}").json())["status"] == "running":
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert (final["status"], final["error"]["type"]) == ("failed", "ResourceLimit"), final["error"]
    assert len(final["tool_calls"]) == 3  # its code's add was refused, not run


def test_the_job_scoped_key_lifecycle(api: Api, make_api) -> None:  # type: ignore[no-untyped-def]
    job = api.run(JOB, toolsets=["demo"], wait=0)
    key = _job_key(api, job["id"])
    stored = ApiKey.objects.get(exec_job_id=job["id"])
    assert stored.key_hash == hashlib.sha256(key.encode()).hexdigest()
    assert stored.revoked_at is None
    client = httpx.Client(base_url=api.http.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=30)

    call = execute(client, {"toolset": "demo", "tool": "add", "arguments": {"a": 1, "b": 1}}, **{"x-ptc-call-id": job["call_id"]})
    assert call.status_code == 200, call.text
    assert call.json()["type"] == "ptc"
    assert call.json()["ptc_call_id"] == job["call_id"]
    assert call.json()["output"] == 2

    other = make_api().run("1", toolsets=["demo"])
    for headers in ({}, {"x-ptc-call-id": other["call_id"]}):
        wrong = execute(client, {"toolset": "demo", "tool": "add", "arguments": {"a": 1, "b": 1}}, **headers)
        assert wrong.status_code == 403
        assert wrong.json()["error"]["code"] == "call_id_mismatch"
    user = stored.user
    outside = Toolset.objects.create(
        key=f"outside_{uuid.uuid4().hex[:6]}", name="Outside", kind="http", owner=user, is_global=False
    )
    scoped = execute(client, {"toolset": outside.key, "tool": "x"}, **{"x-ptc-call-id": job["call_id"]})
    assert scoped.status_code == 403
    assert scoped.json()["error"]["code"] == "toolset_not_granted"
    assert client.get("/api/v1/exec").status_code == 403  # nothing but tools/execute

    final = api.run("1", toolsets=["demo"])  # let the first job end
    deadline = time.monotonic() + 20
    while api.get(f"/api/v1/exec/{job['id']}").json()["status"] == "running":
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert final["status"] == "completed"
    ended = execute(
        client, {"toolset": "demo", "tool": "add", "arguments": {"a": 1, "b": 1}}, **{"x-ptc-call-id": job["call_id"]}
    )
    # Its key is revoked with its end: the caller is told the job ended, not that its key is wrong.
    assert ended.status_code == 409, ended.text
    assert ended.json()["error"]["code"] == "job_ended"
    assert f"Job {job['call_id']} has ended (it is completed)" in ended.json()["error"]["message"]
    assert ApiKey.objects.get(exec_job_id=job["id"]).revoked_at is not None
    # Only there: the key at any other endpoint, or a wrong key of the same prefix, is still a 401.
    assert client.get("/api/v1/exec").status_code == 401
    forged = client.headers["Authorization"][:-4] + "abcd"
    wrong = client.post("/api/v1/tools/execute", json={}, headers={"Authorization": forged})
    assert wrong.status_code == 401
    finished = api.get(f"/api/v1/exec/{job['id']}").json()
    assert [c["tool"] for c in finished["tool_calls"]] == ["echo", "add"]
    outside.delete()


def test_a_jobs_key_is_made_when_its_code_first_reads_it(api: Api) -> None:
    """Most jobs never read their key (their calls go over the bridge): none is made for them, and
    nothing is written for it. One read any number of times is one key."""
    plain = api.run("6 * 7", toolsets=["demo"])
    assert plain["return_value"] == 42
    assert not ApiKey.objects.filter(exec_job_id=plain["id"]).exists()
    code = (
        "from ptc_tools import _runtime\n[_runtime.job_info['key'], _runtime.job_info.get('key'), _runtime.job_info['call_id']]"
    )
    read = api.run(code, toolsets=["demo"])
    first, again, call_id = read["return_value"]
    assert first == again and call_id == read["call_id"]
    [stored] = ApiKey.objects.filter(exec_job_id=read["id"])
    assert stored.key_hash == hashlib.sha256(first.encode()).hexdigest()
    assert stored.revoked_at is not None  # revoked with its job's end


def test_a_sandbox_that_keeps_asking_for_its_key_gets_the_same_one_then_is_stopped(api: Api) -> None:
    ask = "from ptc_tools import _runtime\ncall_id = _runtime.job_info['call_id']\n"
    same = api.run(ask + "len({_runtime._bridge.job_key(call_id) for _ in range(16)})", toolsets=["demo"])
    assert same["status"] == "completed" and same["return_value"] == 1, same
    assert ApiKey.objects.filter(exec_job_id=same["id"]).count() == 1
    other = api.run(ask + "_runtime._bridge.job_key('exec_' + '0' * 32)", toolsets=["demo"])
    assert other["status"] == "failed" and other["error"]["type"] == "ToolError", other
    assert other["error"]["code"] == "job_ended", other["error"]
    flood = api.run(ask + "for _ in range(17):\n    _runtime._bridge.job_key(call_id)", toolsets=["demo"])
    assert flood["status"] == "failed" and flood["error"]["type"] == "BridgeError", flood


def _nested_call(depth: int) -> str:
    """The body of a demo.echo call whose arguments nest ``depth`` levels: the object, then lists.
    Written out by hand: json.dumps of it would itself recurse that deep."""
    lists = depth - 1
    return '{"toolset": "demo", "tool": "echo", "arguments": {"value": ' + "[" * lists + "0" + "]" * lists + "}}"


@pytest.mark.parametrize("depth", [101, 900])
def test_arguments_nested_past_the_limit_are_400_and_nothing_is_recorded(api: Api, depth: int) -> None:
    response = api.post("/api/v1/tools/execute", content=_nested_call(depth), headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid_arguments"
    assert error["details"] == {"limit": 100}
    assert api.get("/api/v1/tool-calls").json()["count"] == 0


def test_arguments_nested_to_the_limit_run(api: Api) -> None:
    response = api.post("/api/v1/tools/execute", content=_nested_call(100), headers={"Content-Type": "application/json"})
    assert response.status_code == 200, response.text
    assert response.json()["status"] == "completed"


def test_a_body_nested_too_deep_to_parse_is_a_parse_error(api: Api) -> None:
    body = '{"toolset": "demo", "tool": "echo", "arguments": {"value": ' + "[" * 100_000 + "]" * 100_000 + "}}"
    response = api.post("/api/v1/tools/execute", content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "parse_error"
    assert api.get("/api/v1/tool-calls").json()["count"] == 0
