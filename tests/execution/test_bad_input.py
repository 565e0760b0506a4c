"""Bad input gets a stable error and harms nothing: the worker takes the next job."""

import json
import os
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Api


def _assert_error(job: dict, status: str, kind: str) -> None:
    assert job["status"] == status, job
    assert job["error"]["type"] == kind, job["error"]
    assert job["error"]["message"]


def test_code_that_is_not_python(api: Api) -> None:
    job = api.run("def (:", toolsets=["demo"])
    _assert_error(job, "failed", "SyntaxError")


def test_code_over_256_kib_is_413(api: Api) -> None:
    response = api.post("/api/v1/exec", json={"code": "#" * (256 * 1024 + 1), "toolsets": ["demo"]})
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "code_too_large"


def test_allocating_10_gb(api: Api) -> None:
    job = api.run("x = bytearray(10 * 1024**3)", toolsets=["demo"])
    _assert_error(job, "failed", "ResourceLimit")
    assert "memory" in job["error"]["message"]


@pytest.mark.skipif(
    os.geteuid() != 0 or not Path("/sys/fs/cgroup/memory").is_dir(),
    reason="a worker holds a job's processes together only with a writable memory cgroup (v1, as root)",
)
def test_a_jobs_processes_are_held_to_its_memory_together(api: Api) -> None:
    # Four processes of 300 MiB: each within the job's 512 MiB, together over it and its scratch.
    code = """
import os, time
children = []
for _ in range(4):
    pid = os.fork()
    if pid == 0:
        block = bytearray(300 << 20)
        for i in range(0, len(block), 4096):
            block[i] = 1
        time.sleep(4)
        os._exit(0)
    children.append(pid)
print(sorted(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in children))
"""
    job = api.run(code, toolsets=["demo"], timeout=60)
    if job["status"] == "failed":  # the kernel took the runner itself
        _assert_error(job, "failed", "ResourceLimit")
        assert "the job's processes together" in job["error"]["message"]
    else:
        statuses = json.loads(job["stdout"])
        assert -9 in statuses, statuses  # killed by the kernel for the job's memory
    assert api.run("1", toolsets=["demo"])["return_value"] == 1


def test_fork_bomb(api: Api) -> None:
    job = api.run("import os\nwhile True:\n    os.fork()", toolsets=["demo"], timeout=10)
    _assert_error(job, "failed", "ResourceLimit")
    assert "process" in job["error"]["message"]


def test_printing_1_gb_keeps_head_and_tail(api: Api) -> None:
    code = "import sys\nprint('FIRST')\nfor _ in range(1024 * 1024):\n    sys.stdout.write('x' * 1023 + '\\n')\nprint('LAST')"
    job = api.run(code, toolsets=["demo"], timeout=60)
    assert job["status"] == "completed", job["error"]
    assert job["stdout_truncated"] is True
    assert job["stdout"].startswith("FIRST\n")
    assert job["stdout"].endswith("LAST\n")
    assert "bytes omitted" in job["stdout"]
    assert len(job["stdout"]) < 1_100_000


def test_os_exit(api: Api) -> None:
    job = api.run("print('bye', flush=True)\nimport os\nos._exit(3)", toolsets=["demo"])
    _assert_error(job, "failed", "SandboxCrashed")
    assert "status 3" in job["error"]["message"]
    assert job["stdout"] == "bye\n"


def test_killing_its_parent(api: Api) -> None:
    job = api.run("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n'survived'", toolsets=["demo"])
    # Its parent is the sandbox's own init, which ignores the signal: the worker is out of reach.
    assert job["status"] == "completed", job["error"]
    assert job["return_value"] == "survived"


def test_setsid_grandchild_is_killed_at_timeout(api: Api) -> None:
    code = """
import subprocess, sys
subprocess.Popen([sys.executable, "-c", "import os, time; os.setsid(); time.sleep(300)"])
import time; time.sleep(300)
"""
    job = api.run(code, toolsets=["demo"], timeout=2)
    _assert_error(job, "timeout", "Timeout")
    import subprocess

    survivors = subprocess.run(["pgrep", "-f", "time.sleep(300)"], capture_output=True, text=True).stdout.split()
    assert survivors == []


@pytest.mark.parametrize(
    ("call", "code"),
    [
        ("_rt.call('nope', 'x', {})", "unknown_toolset"),
        ("_rt.call('demo', 'nope', {})", "unknown_tool"),
        ("_rt.call('demo', 'add', {'a': 1})", "invalid_arguments"),
        ("_rt.call('demo', 'sleep', {'ms': 10**9})", "invalid_arguments"),
        # A search costs a pass over the catalog a word: queries are held to 1,000 characters.
        ("_rt.call('demo', 'catalog_search', {'query': 'a ' * 501})", "invalid_arguments"),
        # A name with a NUL: its error quotes it, and is recorded all the same.
        ("_rt.call('demo', 'no\\x00pe', {})", "unknown_tool"),
    ],
)
def test_bad_calls_get_a_tool_error_with_a_stable_code(api: Api, call: str, code: str) -> None:
    job = api.run(f"from ptc_tools import _runtime as _rt\nfrom ptc_tools.demo import Demo\n{call}", toolsets=["demo"])
    _assert_error(job, "failed", "ToolError")
    assert job["error"]["code"] == code
    [record] = job["tool_calls"]
    assert record["status"] == "failed"
    assert record["error"]["code"] == code


def test_toolset_not_granted_to_the_job(api: Api) -> None:
    job = api.run("from ptc_tools import _runtime as _rt\n_rt.call('demo', 'add', {'a': 1, 'b': 2})", toolsets=[])
    _assert_error(job, "failed", "ToolError")
    assert job["error"]["code"] == "toolset_not_granted"
    # Nor is its module in the job's SDK.
    missing = api.run("import ptc_tools.demo", toolsets=[])
    _assert_error(missing, "failed", "ModuleNotFoundError")


@pytest.mark.parametrize(
    ("frame", "message"),
    [
        (b"\\xff\\xff\\xff\\xff", "over the"),
        (b"\\x00\\x00\\x00\\x05hello", "not valid JSON"),
        (b"\\x00\\x00\\x00\\x02[]", "not a JSON object"),
        (b'\\x00\\x00\\x00\\x0c{"op":"zap"}', "unknown bridge frame"),
        (b'\\x00\\x00\\x00\\x15{"op":"sdk","id":1.5}', "without a whole-number id"),
    ],
)
def test_malformed_frames_end_the_job_clearly(api: Api, frame: bytes, message: str) -> None:
    code = f"""
import os, time
from ptc_tools import _runtime
os.write(_runtime._bridge._sock.fileno(), b'{frame.decode()}')
time.sleep(10)
"""
    job = api.run(code, toolsets=["demo"], timeout=20)
    _assert_error(job, "failed", "BridgeError")
    assert message in job["error"]["message"]


def test_frames_written_by_hand_are_held_to_the_limits_the_sdk_keeps(api: Api) -> None:
    code = """
import time
from ptc_tools import ToolError, _runtime
from ptc_tools.demo import Demo
send = _runtime._bridge.send
_runtime._bridge.send = lambda message, checked=True: send(message, checked=False)  # as code writing its frames
try:
    Demo.echo(value="x" * (2 << 20))
except ToolError as e:
    print(e.code, "|", e.message)
print(Demo.add(a=1, b=2))
_runtime.send({"op": "done", "return_value": [0] * (1 << 20), "error": None}, checked=False)
time.sleep(10)
"""
    job = api.run(code, toolsets=["demo"], timeout=20)
    _assert_error(job, "failed", "ResourceLimit")
    assert "the return value is" in job["error"]["message"] and job["return_value"] is None
    assert job["stdout"].startswith("invalid_arguments | the call is ") and job["stdout"].endswith("\n3\n")
    assert [call["tool"] for call in job["tool_calls"]] == ["add"]  # the refused one never reached a worker


def test_unknown_toolset_in_the_request_is_400(api: Api) -> None:
    response = api.post("/api/v1/exec", json={"code": "1", "toolsets": ["nope"]})
    assert response.status_code == 400
    body = response.json()["error"]
    assert body["code"] == "unknown_toolset"
    assert body["details"] == {"toolsets": ["nope"]}


def test_a_submit_with_several_faults_is_refused_for_the_first_in_order(api: Api) -> None:
    # The policy, the toolsets and the quotas are read together, in one round trip: what they
    # refuse is still checked in order, the timeout before the toolsets.
    from django.contrib.auth import get_user_model

    from execution.services.jobs import exec_job_create
    from ptcproject.errors import ApplicationError
    from ptcproject.policy.selectors import policy_get

    user = get_user_model().objects.get(username=api.username)
    over = float(policy_get().max_timeout + 1)
    with pytest.raises(ApplicationError) as refused:
        exec_job_create(user=user, code="1", toolsets=["nope", "demo"], timeout=over)
    assert (refused.value.code, list(refused.value.details)) == ("validation_error", ["timeout"])
    with pytest.raises(ApplicationError) as refused:
        exec_job_create(user=user, code="1", toolsets=["nope", "demo", "nope"], timeout=None)
    assert (refused.value.code, refused.value.details) == ("unknown_toolset", {"toolsets": ["nope"]})


def test_invalid_request_body_is_a_field_error(api: Api) -> None:
    response = api.post("/api/v1/exec", json={"toolsets": "demo", "wait": 500})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "validation_error"
    assert set(error["details"]) == {"code", "toolsets", "wait"}


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"max_credits": 2**31}, "max_credits"),  # past the column's range: was a 500 from PostgreSQL
        ({"max_credits": 10**30}, "max_credits"),
        ({"timeout": True}, "timeout"),  # a boolean is not a number, not 1 second
        ({"wait": True}, "wait"),
        ({"timeout": "nan"}, "timeout"),
        ({"code": 123}, "code"),  # not run as "123"
        ({"toolsets": [f"t{i}" for i in range(70_000)]}, "toolsets"),  # was 503: past PostgreSQL's parameters
        ({"title": 5}, "title"),
    ],
)
def test_numbers_out_of_range_or_not_numbers_are_field_errors(api: Api, body: dict, field: str) -> None:
    response = api.post("/api/v1/exec", json={"code": "1", "toolsets": ["demo"], **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "validation_error"
    assert set(error["details"]) == {field}
    if field in ("code", "title"):
        assert error["message"] == f"Invalid input. {field}: Send a string, not int."


def test_a_body_over_the_upload_limit_is_413_in_json(api: Api) -> None:
    from django.conf import settings

    body = '{"code": "' + "#" * settings.DATA_UPLOAD_MAX_MEMORY_SIZE + '"}'
    response = api.post("/api/v1/exec", content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 413
    assert response.headers["Content-Type"] == "application/json"
    assert response.json()["error"]["code"] == "code_too_large"
    assert response.json()["error"]["details"] == {"limit": settings.DATA_UPLOAD_MAX_MEMORY_SIZE}


def test_code_at_the_limit_fits_in_the_body_even_escaped(api: Api) -> None:
    # A comment of control characters, each sent as \u0001 (six bytes): the body is six times the
    # code, yet under the body limit, so the answer is about the code, never about the body.
    code = "#" + "\x01" * (256 * 1024 - 1)
    response = api.post("/api/v1/exec", json={"code": code, "toolsets": ["demo"]})
    assert response.status_code == 201, response.text[:300]


def test_a_body_nested_too_deep_to_parse_is_a_parse_error(api: Api) -> None:
    response = api.post("/api/v1/exec", content="[" * 100_000 + "]" * 100_000, headers={"Content-Type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "parse_error"


# Bodies with a lone surrogate where no field's own check reads it first: a files key, a client
# tool's schema, a choice echoed in its error, a staff toolset's config, the policy's mode.
LONE_SURROGATES = [
    ("post", "/api/v1/exec", {"code": "1", "files": {"a\ud800": "YQ=="}}),
    ("post", "/api/v1/exec", {"code": "1", "client_tools": [{"name": "t", "input_schema": {"type": "object", "x\ud800": 1}}]}),
    ("post", "/api/v1/ptc/context", {"format": "x\ud800"}),
    ("post", "/api/v1/toolsets", {"key": "s", "name": "S", "kind": "x\ud800", "config": {"headers": {"h": "\udfff"}}}),
    ("patch", "/api/v1/policy", {"mode": "x\ud800"}),
]


@pytest.mark.parametrize(("method", "path", "body"), LONE_SURROGATES)
def test_a_lone_surrogate_anywhere_in_a_body_is_a_parse_error_not_a_500(
    staff: Api, method: str, path: str, body: dict[str, Any]
) -> None:
    from execution.models import ExecJob

    jobs = ExecJob.objects.count()
    sent = staff.http.request(method, path, content=json.dumps(body), headers={"Content-Type": "application/json"})
    assert sent.status_code == 400, sent.text
    assert sent.json()["error"]["code"] == "parse_error" and "lone surrogate" in sent.json()["error"]["message"]
    assert ExecJob.objects.count() == jobs
    # An escaped pair is one character, not a lone surrogate: an emoji as ensure_ascii writes it.
    emoji = staff.post(
        "/api/v1/exec", content=json.dumps({"code": "'\U0001f600'", "wait": 30}), headers={"Content-Type": "application/json"}
    )
    assert emoji.status_code == 201 and emoji.json()["return_value"] == "\U0001f600", emoji.text


def test_a_lone_surrogate_in_a_body_of_another_charset_is_a_parse_error_too(api: Api) -> None:
    body = json.dumps({"code": "1", "files": {"a\ud800": "YQ=="}})
    for charset in ("utf-16", "utf-32"):  # NULs between its characters: its escapes are read whole
        sent = api.post(
            "/api/v1/exec", content=body.encode(charset), headers={"Content-Type": f"application/json; charset={charset}"}
        )
        assert sent.status_code == 400 and sent.json()["error"]["code"] == "parse_error", (charset, sent.text)
    fine = api.post(
        "/api/v1/exec",
        content=json.dumps({"code": "'é'", "wait": 30}).encode("utf-16"),
        headers={"Content-Type": "application/json; charset=utf-16"},
    )
    assert fine.status_code == 201 and fine.json()["return_value"] == "é", fine.text


def test_a_format_no_renderer_gives_is_406_as_for_an_accept_header(api: Api) -> None:
    for response in (api.get("/api/v1/exec?format=xml"), api.get("/api/v1/exec", headers={"Accept": "application/xml"})):
        assert response.status_code == 406, response.text
        assert response.json()["error"]["code"] == "not_acceptable"
    assert api.get("/api/v1/exec?format=json").status_code == 200


@pytest.mark.parametrize(
    ("path", "status"),
    [
        ("/api/v1/exec?status=%00", 400),
        ("/api/v1/tool-calls?exec=%00", 400),
        ("/api/v1/exec/%00", 404),
        ("/api/v1/toolsets/%00", 404),
    ],
)
def test_a_nul_in_a_path_or_query_is_refused_not_a_500(api: Api, path: str, status: int) -> None:
    response = api.get(path)
    assert response.status_code == status
    assert response.json()["error"]["code"] == ("not_found" if status == 404 else "validation_error")


def test_a_call_id_that_no_call_can_have_is_404_not_a_500(api: Api) -> None:
    response = api.post("/api/v1/tool-calls/%00%ff/approval", json={"approve": True})
    assert (response.status_code, response.json()["error"]["code"]) == (404, "not_found")


def test_timeout_above_the_maximum_is_refused_not_clamped(api: Api) -> None:
    response = api.post("/api/v1/exec", json={"code": "1", "timeout": 10**6})
    assert response.status_code == 400
    assert "timeout" in response.json()["error"]["details"]


def test_after_all_that_the_worker_still_runs_jobs(api: Api) -> None:
    job = api.run("from ptc_tools.demo import Demo\nDemo.add(a=40, b=2)", toolsets=["demo"])
    assert job["return_value"] == 42


def test_a_chunked_body_is_411_not_read_as_empty(api: Api) -> None:
    body = iter([b'{"code": "1", ', b'"toolsets": ["demo"]}'])  # no Content-Length: sent chunked
    response = api.http.post("/api/v1/exec", content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 411, response.text
    assert response.json()["error"]["code"] == "length_required"
