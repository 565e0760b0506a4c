"""What a hostile tester found, kept found: each of these once harmed a job, the worker or the host."""

import time
import uuid
from datetime import timedelta

from django.contrib.auth import get_user_model
from django.utils import timezone

from execution.models import ExecJob
from execution.services.jobs import exec_jobs_reap
from tests.conftest import Api
from tests.factories import demo_call, running_job


def test_io_uring_and_new_namespaces_are_refused(api: Api) -> None:
    code = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
def errno_of(result):
    return ctypes.get_errno() if result == -1 else "allowed"
uring = errno_of(libc.syscall(425, 8, ctypes.create_string_buffer(120)))   # io_uring_setup
userns = errno_of(libc.syscall(56, 0x10000000 | 17, 0, 0, 0, 0))         # clone(CLONE_NEWUSER)
netns = errno_of(libc.syscall(56, 0x40000000 | 17, 0, 0, 0, 0))          # clone(CLONE_NEWNET)
(uring, userns, netns)
"""
    job = api.run(code, toolsets=["demo"])
    assert job["status"] == "completed", job["error"]
    assert job["return_value"] == [1, 1, 1]  # EPERM each


def test_threads_fork_and_subprocess_still_work(api: Api) -> None:
    code = """
import os, subprocess, threading
t = threading.Thread(target=lambda: None); t.start(); t.join()
pid = os.fork()
if pid == 0:
    os._exit(0)
os.waitpid(pid, 0)
subprocess.run(["/usr/bin/true"]).returncode
"""
    assert api.run(code, toolsets=["demo"])["return_value"] == 0


def test_only_size_capped_scratch_is_writable(api: Api) -> None:
    code = """
import os
def writable(path):
    try:
        with open(path, "wb") as f:
            f.write(b"x")
        return True
    except OSError:
        return False
sizes = {p: os.statvfs(p).f_blocks * os.statvfs(p).f_frsize >> 20 for p in ("/work", "/tmp", "/dev/shm")}
({p: writable(p + "/probe") for p in ("", "/etc", "/dev", "/usr", "/work", "/tmp", "/dev/shm")}, sizes)
"""
    job = api.run(code, toolsets=["demo"])
    writable, sizes = job["return_value"]
    assert writable == {"": False, "/etc": False, "/dev": False, "/usr": False, "/work": True, "/tmp": True, "/dev/shm": True}
    assert all(size <= 64 for size in sizes.values()), sizes


def test_nul_characters_are_stored_not_fatal(api: Api) -> None:
    code = """
from ptc_tools import ToolError
from ptc_tools.demo import Demo
print("a\\x00b")
for value in ("c\\x00d", {"k\\x00": 1}, ["\\ud800"], float("nan")):
    try:
        Demo.echo(value=value)
    except ToolError as e:
        print(e.code, "|", e.message)
Demo.echo(value="c\\ufffdd")
"""
    job = api.run(code, toolsets=["demo"])
    assert job["status"] == "completed", job["error"]
    # What the code printed is output: stored with the NUL replaced. Arguments are what the tool
    # gets, as recorded: refused rather than changed to fit.
    printed, nul, key, surrogate, nan = job["stdout"].splitlines()
    assert printed == "a\ufffdb"
    assert nul == "invalid_arguments | value: holds a NUL character (U+0000), which can't be stored"
    assert key == "invalid_arguments | value/k\ufffd (a key): holds a NUL character (U+0000), which can't be stored"
    assert surrogate == "invalid_arguments | value/0: holds a lone surrogate, which is not text"
    assert nan.startswith("invalid_arguments | arguments cannot be sent: Out of range float")  # by the SDK
    assert job["return_value"] == "c\ufffdd"
    assert [c["status"] for c in job["tool_calls"]] == ["failed"] * 3 + ["completed"]
    assert job["tool_calls"][0]["input"] == {"value": "c\ufffdd"}  # the refused call's record, stored
    failed = api.run('raise ValueError("x\\x00y")', toolsets=["demo"])
    assert failed["status"] == "failed"
    assert failed["error"]["message"] == "x\ufffdy"


def test_oversized_arguments_and_return_values_are_clear_errors(api: Api) -> None:
    code = """
from ptc_tools import ToolError
from ptc_tools.demo import Demo
try:
    Demo.echo(value="x" * (3 << 20))
except ToolError as e:
    print(e.code)
"y" * (3 << 20)
"""
    job = api.run(code, toolsets=["demo"])
    assert job["stdout"] == "invalid_arguments\n"
    assert job["error"]["type"] == "ResourceLimit"
    assert "return value" in job["error"]["message"]


def test_odd_exceptions_and_values_are_still_reported(api: Api) -> None:
    raising = api.run(
        "class E(Exception):\n    def __str__(self):\n        raise KeyboardInterrupt\nraise E()", toolsets=["demo"]
    )
    assert raising["status"] == "failed"
    assert raising["error"]["type"] == "E"
    # Too deep to store or read back: the job fails with a stable type, and keeps its output.
    deep = api.run("print('kept')\nx = []\nfor _ in range(5000):\n    x = [x]\nx", toolsets=["demo"])
    assert deep["status"] == "failed"
    assert deep["error"]["type"] == "ResourceLimit"
    assert "nests deeper than 100 levels" in deep["error"]["message"]
    assert deep["stdout"] == "kept\n"
    surrogate = api.run('"\\ud800"', toolsets=["demo"])
    assert surrogate["status"] == "completed"


def test_a_flood_of_calls_is_held_back_not_buffered(api: Api) -> None:
    code = """
import threading
from ptc_tools.demo import Demo
threads = [threading.Thread(target=Demo.sleep, kwargs={"ms": 50}) for _ in range(150)]
[t.start() for t in threads]
[t.join() for t in threads]
"""
    job = api.run(code, toolsets=["demo"])
    assert job["status"] == "completed", job["error"]
    assert len(job["tool_calls"]) == 150
    assert all(c["status"] == "completed" for c in job["tool_calls"])


def test_a_forged_result_frame_is_refused(api: Api) -> None:
    code = """
import time
from ptc_tools import _runtime
_runtime.send({"op": "done", "return_value": 1, "error": [1, 2]})
time.sleep(5)
"""
    job = api.run(code, toolsets=["demo"], timeout=20)
    assert job["error"]["type"] == "BridgeError"


def test_a_result_frames_error_is_shown_as_the_api_promises(api: Api) -> None:
    # The code may send its own result: its error is taken as type, message and a text traceback.
    code = """
import time
from ptc_tools import _runtime
_runtime.send({"op": "done", "return_value": None, "error": {"type": "X", "message": "m", "traceback": 5, "code": [1]}})
time.sleep(5)
"""
    job = api.run(code, toolsets=["demo"], timeout=20)
    assert job["error"] == {"type": "X", "message": "m", "traceback": ""}


def test_code_that_replaces_json_keeps_its_bridge(api: Api) -> None:
    # Code may patch json (to encode its own types, say): the runner and the SDK encode with their own.
    code = """
import json
json.dumps = json.loads = json.load = None
import ptc_tools
from ptc_tools.demo import Demo
[Demo.add(a=1, b=2), {'k': 1}, ptc_tools.describe('demo.add')['name'], 'input_schema' in str(ptc_tools.describe('demo.add'))]
"""
    job = api.run(code, toolsets=["demo"])
    assert (job["status"], job["return_value"]) == ("completed", [3, {"k": 1}, "add", True]), job["error"]


def test_reloading_the_runtime_keeps_the_sandboxs_bridge(api: Api) -> None:
    code = "import importlib, ptc_tools._runtime as rt\nimportlib.reload(rt)\nfrom ptc_tools.demo import Demo\nDemo.add(a=1, b=1)"
    job = api.run(code, toolsets=["demo"])
    assert (job["status"], job["return_value"]) == ("completed", 2), job["error"]
    # The package too: its path still has the job's SDK, for imports and for describe and search.
    code = """
import importlib, ptc_tools
importlib.reload(ptc_tools)
from ptc_tools.demo import Demo
[Demo.add(a=1, b=1), ptc_tools.search("add two numbers")[0].split("(")[0], ptc_tools.describe("demo.add")["name"]]
"""
    job = api.run(code, toolsets=["demo"])
    assert (job["status"], job["return_value"]) == ("completed", [2, "demo.add", "add"]), job["error"]


def test_unknown_api_paths_answer_in_the_error_shape(api: Api) -> None:
    for path in ("/api/v1/nope", "/api/v1/exec/not-a-uuid"):
        response = api.get(path)
        assert response.status_code == 404
        assert response.json()["error"]["code"] == "not_found"


def test_a_job_whose_queue_message_was_lost_is_failed() -> None:
    user = get_user_model().objects.create_user(username=f"lost-{uuid.uuid4().hex[:6]}")
    job = ExecJob.objects.create(user=user, code="1", toolsets=[], timeout_seconds=10)
    ExecJob.objects.filter(pk=job.pk).update(created_at=timezone.now() - timedelta(hours=2))
    exec_jobs_reap()
    job.refresh_from_db()
    assert job.status == "failed"
    assert job.error["type"] == "WorkerLost"
    assert "queue message was lost" in job.error["message"]


def test_the_reaper_fails_an_unclaimed_call_left_behind_but_not_a_long_call_under_its_lease() -> None:
    from django.conf import settings

    user = get_user_model().objects.create_user(username=f"long-{uuid.uuid4().hex[:6]}")
    now = timezone.now()
    half_an_hour_ago, past_any_timeout = now - timedelta(minutes=30), now - timedelta(seconds=settings.PTC_TIMEOUT_CEILING + 600)
    # A standalone call a tools worker claimed half an hour ago and still renews (a tool's timeout
    # may be up to PTC_TIMEOUT_CEILING), one claimed past any tool's timeout (its lease renewed, its
    # tool never returned), and one no worker ever took.
    running = demo_call(user=user, tool="sleep", started_at=half_an_hour_ago, claimed_at=half_an_hour_ago, heartbeat_at=now)
    stuck = demo_call(user=user, tool="sleep", started_at=past_any_timeout, claimed_at=past_any_timeout, heartbeat_at=now)
    lost = demo_call(user=user, started_at=half_an_hour_ago)
    exec_jobs_reap()
    for call in (running, stuck, lost):
        call.refresh_from_db()
    assert (running.status, running.error) == ("executing", None)
    assert (stuck.status, stuck.error["code"]) == ("failed", "worker_lost")
    assert (lost.status, lost.error["code"]) == ("failed", "worker_lost")


def test_a_job_cancelled_as_its_worker_died_is_closed_by_the_reaper() -> None:
    from execution.backplane import backplane
    from execution.events import output_publish

    user = get_user_model().objects.create_user(username=f"orphan-{uuid.uuid4().hex[:6]}")
    job = running_job(user=user)
    waiting = demo_call(user=user, job=job, status="awaiting_approval")
    output_publish(job_call_id=job.call_id, output=[("stdout", "printed before the kill\n")])
    # What a cancel writes on a running job, leaving the rest to its worker, which died meanwhile.
    ExecJob.objects.filter(pk=job.pk).update(status="cancelled", finished_at=timezone.now() - timedelta(hours=1))
    exec_jobs_reap()
    # The stack's own workers reap too: one may have closed the job first, and still be ending it.
    deadline = time.monotonic() + 10
    names: list[str] = []
    while names[-1:] != ["exec_end"] and time.monotonic() < deadline:
        names = [name for _, name, _ in backplane().events_read(job.call_id)]
        time.sleep(0.05)
    assert names[-2:] == ["tool_call_error", "exec_end"]
    job.refresh_from_db()
    waiting.refresh_from_db()
    assert job.closed_at is not None and (job.status, job.stdout) == ("cancelled", "printed before the kill\n")
    assert (waiting.status, waiting.error["code"]) == ("failed", "job_ended")
    closed = job.closed_at
    exec_jobs_reap()  # closed once
    job.refresh_from_db()
    assert job.closed_at == closed


def test_sandbox_hostname_and_boot_arguments_stay_private(api: Api) -> None:
    code = """
import socket
try:
    cmdline = open("/proc/cmdline").read()
except OSError:
    cmdline = ""
(socket.gethostname(), cmdline)
"""
    assert api.run(code, toolsets=["demo"])["return_value"] == ["sandbox", ""]
