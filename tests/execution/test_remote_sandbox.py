"""Remote sandboxes: the SDK, with no bridge, calls tools over HTTP with the job-scoped key, and
that path holds the job to the same max_tool_calls, parallel cap and sequential as the bridge (its
bridge admits them: tests/execution/test_job_call_limits.py has the two ways at once)."""

import json
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from django.conf import settings

from execution.models import ToolCall
from tests.conftest import Api
from tests.execution.test_tools_execute import _job_key

HOLDER = """
import time
from ptc_tools import _runtime
from ptc_tools.demo import Demo
Demo.echo(value=_runtime.job_info["key"])  # hands the test this job's key through the call record
time.sleep(60)
"""

REMOTE = """
import json, sys, threading, time
from ptc_tools import ToolError
from ptc_tools.demo import Demo

out = {"add": Demo.add(a=1, b=2)}
started = time.monotonic()
threads = [threading.Thread(target=Demo.sleep, kwargs={"ms": 400}) for _ in range(int(sys.argv[1]))]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
out["sleeps_s"] = time.monotonic() - started
try:
    for i in range(int(sys.argv[2])):
        Demo.add(a=i, b=0)
except ToolError as exc:
    out["refused"] = [exc.code, i]
print(json.dumps(out))
"""


def _most_at_once(calls: list[ToolCall]) -> int:
    """The most of ``calls`` whose [recorded, finished] spans overlap at one moment."""
    edges = sorted([(c.started_at, 1) for c in calls] + [(c.finished_at, -1) for c in calls], key=lambda e: (e[0], e[1]))
    most = now = 0
    for _, step in edges:
        now += step
        most = max(most, now)
    return most


def _remote(api: Api, sdk_dir: Path, key: str, call_id: str, *args: int) -> dict[str, Any]:
    """Run the SDK on "another host": a plain interpreter with no bridge, only the API's URL and the key."""
    env = {"PTC_API_URL": str(api.http.base_url), "PTC_JOB_KEY": key, "PTC_JOB_CALL_ID": call_id, "PYTHONPATH": str(sdk_dir)}
    done = subprocess.run(
        [settings.PTC_SANDBOX_PYTHON, "-c", REMOTE, *map(str, args)], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _sdk_written(api: Api, folder: Path) -> None:
    """Write the demo toolset's SDK, as GET /sdk gives it, under ``folder``: a remote sandbox's."""
    sdk = api.get("/api/v1/sdk", params={"toolset_keys": "demo"}).json()
    for name, text in sdk["files"].items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)


def test_the_sdk_calls_over_http_within_the_jobs_limits(api: Api, staff: Api, tmp_path: Path) -> None:
    # The limits the job runs under, made small for the test: its bridge holds its calls over HTTP to
    # them too, as it started (a policy changed since holds the next job).
    assert staff.http.patch("/api/v1/policy", json={"max_tool_calls": 10, "max_parallel_tool_calls": 2}).status_code == 200
    job = api.run(HOLDER, toolsets=["demo"], wait=0)
    key = _job_key(api, job["id"])
    _sdk_written(api, tmp_path)
    try:
        out = _remote(api, tmp_path, key, job["call_id"], 6, 5)
        assert out["add"] == 3
        # 1 echo + 1 add + 6 sleeps + 2 adds = 10: the third add is refused, as the bridge would.
        assert out["refused"] == ["tool_call_limit", 2]
        sleeps = list(ToolCall.objects.filter(exec_job_id=job["id"], tool_name="sleep"))
        assert len(sleeps) == 6 and all(c.status == "completed" for c in sleeps)
        assert all(c.type == "ptc" and c.ptc_call_id == job["call_id"] for c in sleeps)
        assert _most_at_once(sleeps) == 2  # the parallel cap: the others waited their turn
        assert out["sleeps_s"] >= 1.1  # three rounds of 0.4 s
        assert ToolCall.objects.filter(exec_job_id=job["id"]).count() == 10
    finally:
        assert api.post(f"/api/v1/exec/{job['id']}/cancel").status_code == 200

    # Sequential: one call at a time, whatever the code asks.
    assert staff.http.patch("/api/v1/policy", json={"sequential": True, "max_tool_calls": 100}).status_code == 200
    one_by_one = api.run(HOLDER, toolsets=["demo"], wait=0)
    try:
        out = _remote(api, tmp_path, _job_key(api, one_by_one["id"]), one_by_one["call_id"], 3, 0)
        sleeps = list(ToolCall.objects.filter(exec_job_id=one_by_one["id"], tool_name="sleep"))
        assert len(sleeps) == 3 and _most_at_once(sleeps) == 1
        assert out["sleeps_s"] >= 1.1
    finally:
        assert api.post(f"/api/v1/exec/{one_by_one['id']}/cancel").status_code == 200
    # The job has ended: its key is revoked and the remote SDK's calls fail, saying the job ended.
    time.sleep(0.5)
    done = subprocess.run(
        [
            settings.PTC_SANDBOX_PYTHON,
            "-c",
            "from ptc_tools.demo import Demo\ntry:\n    Demo.add(a=1, b=1)\nexcept Exception as e:\n    print(e.code)",
        ],
        env={
            "PTC_API_URL": str(api.http.base_url),
            "PTC_JOB_KEY": key,
            "PTC_JOB_CALL_ID": job["call_id"],
            "PYTHONPATH": str(tmp_path),
        },
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.stdout.strip() == "job_ended", done.stderr


UNSENDABLE = """
import json
from ptc_tools import ToolError
from ptc_tools.demo import Demo

json.dumps = lambda *a, **k: "not json"  # the code's own: the SDK's calls don't go through it
out = []
for value in (float("nan"), float("inf")):
    try:
        Demo.echo(value=value)
    except ToolError as exc:
        out.append([exc.code, exc.message])
out.append(Demo.echo(value="sent"))
print(json.JSONEncoder().encode(out))
"""


def test_arguments_that_are_not_json_are_refused_by_the_sdk_over_http_as_over_the_bridge(api: Api, tmp_path: Path) -> None:
    """NaN and infinities are not JSON: the bridge's SDK refuses them (invalid_arguments, "cannot be
    sent"), and so does the HTTP path, rather than post what the API can't parse. Neither uses a
    json.dumps the code replaced."""
    job = api.run(HOLDER, toolsets=["demo"], wait=0)
    key = _job_key(api, job["id"])
    _sdk_written(api, tmp_path)
    env = {
        "PTC_API_URL": str(api.http.base_url),
        "PTC_JOB_KEY": key,
        "PTC_JOB_CALL_ID": job["call_id"],
        "PYTHONPATH": str(tmp_path),
    }
    try:
        done = subprocess.run(
            [settings.PTC_SANDBOX_PYTHON, "-c", UNSENDABLE], env=env, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        *refused, sent = json.loads(done.stdout)
        assert sent == "sent"
        assert [code for code, _ in refused] == ["invalid_arguments", "invalid_arguments"], refused
        assert all(message.startswith("arguments cannot be sent: Out of range float") for _, message in refused), refused
        # Nothing was sent for them: the job has its key's echo and the one call that was.
        assert [c.tool_name for c in ToolCall.objects.filter(exec_job_id=job["id"]).order_by("started_at")] == ["echo", "echo"]
    finally:
        assert api.post(f"/api/v1/exec/{job['id']}/cancel").status_code == 200


class _NotTheApi(BaseHTTPRequestHandler):
    """What may answer a remote sandbox in the API's place (a proxy, a restart): its Nth request
    gets the Nth of ANSWERS: a status, a body, and how many bytes of it are sent before the cut."""

    served = 0

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        status, body, sent = ANSWERS[type(self).served % len(ANSWERS)]
        type(self).served += 1
        self.send_response(status)
        self.send_header("Content-Type", "text/html" if body.startswith(b"<") else "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body[:sent])
        self.wfile.flush()
        self.close_connection = True

    def log_message(self, *args: Any) -> None:
        pass


ANSWERS = [
    (200, b"<html>welcome to the hotel wifi</html>", 1000),
    (200, b"[1, 2]", 1000),
    (502, b"[1, 2]", 1000),
    (502, b'{"error": "bad gateway"}', 1000),
    (200, b'{"status": "completed", "output": "cut off"}', 10),
]

CALLS = """
import json
from ptc_tools import ToolError
from ptc_tools.demo import Demo
out = []
for _ in range(5):
    try:
        out.append(["ok", Demo.echo(value=1)])
    except ToolError as exc:
        out.append([exc.code, exc.message])
print(json.dumps(out))
"""


def test_an_answer_that_is_not_the_apis_is_a_tool_error_for_the_code(api: Api, tmp_path: Path) -> None:
    """A remote SDK's call answered by something else (a page, JSON that is not a record or an
    error, a body cut off) raises ToolError with a stable code, as any failed call does: never a
    ValueError, AttributeError or http.client.IncompleteRead from the SDK's insides."""
    _sdk_written(api, tmp_path)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _NotTheApi)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        env = {
            "PTC_API_URL": f"http://127.0.0.1:{server.server_address[1]}",
            "PTC_JOB_KEY": "ptc_x_y",
            "PTC_JOB_CALL_ID": "exec_" + "0" * 32,
            "PYTHONPATH": str(tmp_path),
        }
        done = subprocess.run([settings.PTC_SANDBOX_PYTHON, "-c", CALLS], env=env, capture_output=True, text=True, timeout=60)
    finally:
        server.shutdown()
        server.server_close()
    assert done.returncode == 0, done.stderr
    page, listed, listed_error, text_error, cut = json.loads(done.stdout)
    assert page == ["internal_error", "the API's answer is not a tool call's record: b'<html>welcome to the hotel wifi</html>'"]
    assert listed == ["internal_error", "the API's answer is not a tool call's record: b'[1, 2]'"]
    assert listed_error == ["tool_error", "HTTP Error 502: Bad Gateway"]
    assert text_error == ["tool_error", "HTTP Error 502: Bad Gateway"]
    assert cut[0] == "bridge_closed" and cut[1].startswith("the API could not be reached: IncompleteRead"), cut
