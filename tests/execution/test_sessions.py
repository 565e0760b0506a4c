"""Sessions on the real stack: a sandbox kept between jobs, its files, its expiry, its owner."""

import base64
import contextlib
import hashlib
import io
import os
import signal
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from execution.models import WorkFile
from tests.conftest import Api
from tests.stack import Stack


def _session(api: Api, **body: Any) -> dict[str, Any]:
    response = api.post("/api/v1/sessions", json={"toolsets": ["demo"], **body})
    assert response.status_code == 201, response.text
    return response.json()


def _run(api: Api, session: dict[str, Any], code: str, **body: Any) -> dict[str, Any]:
    return api.run(code, session=session["id"], **body)


def _until(api: Api, path: str, done: Callable[[dict[str, Any]], bool], seconds: float = 20) -> dict[str, Any]:
    deadline = time.monotonic() + seconds
    while not done(body := api.get(path).json()):
        assert time.monotonic() < deadline, f"{path} did not get there within {seconds} s: {body}"
        time.sleep(0.1)
    return body


def test_globals_imports_and_files_persist_between_jobs(api: Api) -> None:
    session = _session(api)
    assert session["status"] == "active" and session["expires_at"]
    first = _run(api, session, "import json\nx = 41\nopen('notes.txt', 'w').write('kept')\nprint('one')")
    assert first["status"] == "completed", first["error"]
    assert first["session"] == session["id"]
    assert first["output_files"] == [{"path": "notes.txt", "size": 4}]
    second = _run(api, session, "print('two')\n[x + 1, json.dumps({'a': 1}), open('/work/notes.txt').read()]")
    assert second["status"] == "completed", second["error"]
    assert second["return_value"] == [42, '{"a": 1}', "kept"]
    # Each call is its own job: its own record, output and end.
    assert second["id"] != first["id"] and second["call_id"] != first["call_id"]
    assert (first["stdout"], second["stdout"]) == ("one\n", "two\n")
    assert second["output_files"] == []  # nothing changed under /work this time
    got = api.get(f"/api/v1/sessions/{session['id']}").json()
    assert got["jobs_run"] == 2 and got["status"] == "active"
    listed = api.get("/api/v1/sessions").json()["results"]
    assert session["id"] in [s["id"] for s in listed]


LEAVE_A_CALL_AND_AN_ASK = """
import threading
from ptc_tools import _runtime, describe
from ptc_tools.demo import Demo
outcomes = []
def call():
    try:
        outcomes.append(Demo.sleep(ms=3000))
    except Exception as exc:
        outcomes.append(getattr(exc, "code", repr(exc)))
caller = threading.Thread(target=call, daemon=True)
caller.start()
while not _runtime._bridge._pending:  # the call is out before the job ends
    pass
# The catalog's first read asks for it, holding the SDK's lock until the answer comes: the ask is
# held back to go out with the job's result.
lock = _runtime._bridge._send_lock
lock.acquire()
threading.Thread(target=describe, args=("demo.add",), daemon=True).start()
threading.Timer(0.02, lock.release).start()
"""


def test_what_a_session_job_leaves_asking_is_answered_before_the_next_job(api: Api) -> None:
    # A thread of the code still waiting on a call, or on an SDK file it asked for as the job
    # ended, is answered then: the next job's calls and imports are not held up behind it.
    for _ in range(3):
        session = _session(api)
        first = _run(api, session, LEAVE_A_CALL_AND_AN_ASK)
        assert first["status"] == "completed", first["error"]
        after = "caller.join(10)\n[outcomes, Demo.add(a=1, b=2), describe('demo.add') is not None]"
        second = _run(api, session, after, timeout=20)
        assert second["status"] == "completed", second["error"]
        assert second["return_value"] == [["job_ended"], 3, True]


def test_a_result_a_job_sent_itself_is_not_the_next_jobs(api: Api) -> None:
    session = _session(api)
    forged = """
import time
from ptc_tools import _runtime
_runtime.send({"op": "done", "return_value": "sent by the code", "error": None, "job": _runtime.job_info["call_id"]})
time.sleep(0.5)
'its runner sends this one after'
"""
    first = _run(api, session, forged)
    assert (first["status"], first["return_value"]) == ("completed", "sent by the code")  # its own to choose
    second = _run(api, session, "import time\ntime.sleep(1)\n'the second'")
    assert (second["status"], second["return_value"]) == ("completed", "the second"), second
    third = _run(api, session, "'the third'")
    assert (third["status"], third["return_value"]) == ("completed", "the third"), third


def test_a_client_tool_of_an_earlier_job_called_in_a_job_without_them_says_so(api: Api) -> None:
    # The session's globals keep the Client class an earlier job imported; a later job made without
    # client_tools that calls it was told "there is no toolset 'client'", of a module it had used.
    session = _session(api)
    once = {"name": "once", "input_schema": {"type": "object", "properties": {"n": {"type": "integer"}}}}
    first = api.post(
        "/api/v1/exec",
        json={"session": session["id"], "client_tools": [once], "wait": 0, "code": "from ptc_tools.client import Client\n1"},
    )
    assert first.status_code == 201, first.text
    _until(api, f"/api/v1/exec/{first.json()['id']}", lambda job: job["status"] == "completed")
    second = _run(api, session, "Client.once(n=1)")
    assert second["status"] == "failed" and second["error"]["type"] == "ToolError", second
    [call] = second["tool_calls"]
    assert call["error"]["code"] == "unknown_toolset"
    assert "no client tools" in call["error"]["message"] and "client_tools" in call["error"]["message"], call["error"]


def test_one_job_at_a_time_the_second_is_409(api: Api) -> None:
    session = _session(api)
    running = _run(api, session, "import time\nprint('in', flush=True)\ntime.sleep(2)\n'first'", wait=0)
    busy = api.post("/api/v1/exec", json={"code": "1", "session": session["id"]})
    assert busy.status_code == 409, busy.text
    assert busy.json()["error"]["code"] == "session_busy"
    assert busy.json()["error"]["details"]["job"] == running["id"]
    done = _until(api, f"/api/v1/exec/{running['id']}", lambda job: job["status"] not in ("queued", "running"))
    assert done["return_value"] == "first"
    assert _run(api, session, "'after'")["return_value"] == "after"


def test_an_idle_session_expires_and_answers_410(api: Api) -> None:
    session = _session(api, idle_timeout=1)
    assert _run(api, session, "y = 1\ny")["return_value"] == 1
    ended = _until(api, f"/api/v1/sessions/{session['id']}", lambda s: s["status"] != "active")
    assert ended["status"] == "expired"
    assert "idle_timeout" in ended["end_reason"]
    late = api.post("/api/v1/exec", json={"code": "y", "session": session["id"]})
    assert late.status_code == 410, late.text
    error = late.json()["error"]
    assert error["code"] == "session_expired"
    assert error["details"]["expires_at"] and error["details"]["status"] == "expired"


def test_a_session_expires_at_its_max_lifetime_however_busy(api: Api) -> None:
    session = _session(api, idle_timeout=600, max_lifetime=3)
    for _ in range(2):
        assert _run(api, session, "1")["status"] == "completed"
    ended = _until(api, f"/api/v1/sessions/{session['id']}", lambda s: s["status"] != "active")
    assert ended["status"] == "expired"
    assert "max_lifetime" in ended["end_reason"]
    assert api.post("/api/v1/exec", json={"code": "1", "session": session["id"]}).status_code == 410


def test_a_job_running_as_its_session_ends_is_told_why(api: Api) -> None:
    # Its worker kills the sandbox of a session that ended (the reaper recorded it expired) at its
    # next lease round; the job's error said only "the session ended while the job ran: the
    # session ended", not what ended it.
    session = _session(api, idle_timeout=600, max_lifetime=3)
    job = _run(api, session, "import time\ntime.sleep(30)", timeout=60)
    assert (job["status"], job["error"]["type"]) == ("failed", "SessionEnded")
    assert job["error"]["message"] == "the session ended while the job ran: it is expired: it reached its max_lifetime of 3 s"


def test_a_deleted_session_answers_410(api: Api) -> None:
    session = _session(api)
    assert _run(api, session, "z = 3")["status"] == "completed"
    assert api.get(f"/api/v1/sessions/{session['id']}/files").json()["count"] == 0
    api.post(f"/api/v1/sessions/{session['id']}/files", files={"file": ("gone.txt", b"x")})
    deleted = api.http.delete(f"/api/v1/sessions/{session['id']}")
    assert deleted.status_code == 200 and deleted.json()["status"] == "deleted"
    assert api.get(f"/api/v1/sessions/{session['id']}/files").json()["count"] == 0  # its files went with it
    late = api.post("/api/v1/exec", json={"code": "z", "session": session["id"]})
    assert late.status_code == 410 and late.json()["error"]["code"] == "session_expired"


def test_a_timed_out_job_ends_its_session_lost(api: Api) -> None:
    session = _session(api)
    job = _run(api, session, "import time\ntime.sleep(30)", timeout=1)
    assert job["status"] == "timeout"
    got = api.get(f"/api/v1/sessions/{session['id']}").json()
    assert got["status"] == "lost" and "killed" in got["end_reason"]
    late = api.post("/api/v1/exec", json={"code": "1", "session": session["id"]})
    assert late.status_code == 410 and late.json()["error"]["code"] == "session_lost"


def test_deleting_a_session_cancels_its_running_job(api: Api) -> None:
    session = _session(api)
    job = _run(api, session, "import time\nprint('in', flush=True)\ntime.sleep(60)", wait=0, timeout=120)
    assert api.until_printed(job["id"]) == "in\n"
    assert api.http.delete(f"/api/v1/sessions/{session['id']}").json()["status"] == "deleted"
    ended = _until(api, f"/api/v1/exec/{job['id']}", lambda j: j["status"] not in ("queued", "running"), 15)
    assert ended["status"] == "cancelled"


def test_cancelling_a_running_job_ends_its_session_lost(api: Api) -> None:
    session = _session(api)
    job = _run(api, session, "import time\nprint('in', flush=True)\ntime.sleep(60)", wait=0, timeout=120)
    assert api.until_printed(job["id"]) == "in\n"
    assert api.post(f"/api/v1/exec/{job['id']}/cancel").status_code == 200
    ended = _until(api, f"/api/v1/sessions/{session['id']}", lambda s: s["status"] != "active", 15)
    assert ended["status"] == "lost"


def test_a_job_submitted_as_a_running_job_is_cancelled_is_busy_then_lost(api: Api, stack: Stack) -> None:
    # The job reads cancelled at once, but its worker still holds the sandbox until it has killed
    # it: a submit meanwhile is 409 session_busy, and then 410 session_lost, never a job let in to
    # find the sandbox taken. The worker is stopped for the moment of the cancel, so the window is;
    # shorter than its lease (the cancel's answer, which waits for the job's end, is not waited for
    # there): stopped past it, the reaper, which any worker runs, ends the session lost at once.
    session = _session(api)
    job = _run(api, session, "import time\nprint('in', flush=True)\ntime.sleep(60)", wait=0, timeout=120)
    assert api.until_printed(job["id"]) == "in\n"
    assert stack.exec_worker.proc is not None
    worker = stack.exec_worker.proc.pid
    with ThreadPoolExecutor(1) as pool:
        os.kill(worker, signal.SIGSTOP)
        try:
            cancelled = pool.submit(api.post, f"/api/v1/exec/{job['id']}/cancel")
            deadline = time.monotonic() + 3
            while api.get(f"/api/v1/exec/{job['id']}").json()["status"] != "cancelled":
                assert time.monotonic() < deadline, "the job did not read cancelled at once"
                time.sleep(0.02)
            busy = api.post("/api/v1/exec", json={"code": "1", "session": session["id"]})
            assert busy.status_code == 409 and busy.json()["error"]["code"] == "session_busy", busy.text
        finally:
            os.kill(worker, signal.SIGCONT)
        assert cancelled.result().status_code == 200
    deadline = time.monotonic() + 20
    while (late := api.post("/api/v1/exec", json={"code": "1", "session": session["id"]})).status_code == 409:
        assert late.json()["error"]["code"] == "session_busy"
        assert time.monotonic() < deadline, "the cancelled job held its session for 20 s"
        time.sleep(0.05)
    assert late.status_code == 410 and late.json()["error"]["code"] == "session_lost", late.text


def test_the_memory_limit_holds_across_calls(api: Api) -> None:
    session = _session(api, limits={"memory_mb": 256})
    assert session["limits"]["memory_mb"] == 256
    assert _run(api, session, "a = bytearray(150 << 20)\nlen(a)")["return_value"] == 150 << 20
    # The second allocation alone would fit; with the first still held, it can't.
    over = _run(api, session, "b = bytearray(150 << 20)")
    assert over["status"] == "failed" and over["error"]["type"] == "ResourceLimit", over["error"]
    assert _run(api, session, "len(a)")["return_value"] == 150 << 20  # the session goes on


def test_the_disk_limit_holds_across_calls(api: Api) -> None:
    session = _session(api)
    first = _run(api, session, "open('a.bin', 'wb').write(bytes(40 << 20))")
    assert first["status"] == "completed" and first["output_files_omitted"] == ["a.bin"]  # over the files quota
    # /work is one 64 MiB tmpfs for the session's life: the first call's 40 MiB are still there.
    second = _run(api, session, "open('b.bin', 'wb').write(bytes(40 << 20))")
    assert second["status"] == "failed" and "No space left" in second["error"]["message"], second["error"]
    assert _run(api, session, "import os\nos.path.getsize('a.bin')")["return_value"] == 40 << 20


def test_a_sandbox_that_exits_between_calls_ends_its_session_lost(api: Api) -> None:
    session = _session(api)
    code = "import os, threading, time\nthreading.Thread(target=lambda: (time.sleep(0.3), os._exit(3))).start()\n'left'"
    assert _run(api, session, code)["return_value"] == "left"
    ended = _until(api, f"/api/v1/sessions/{session['id']}", lambda s: s["status"] != "active", 15)
    assert ended["status"] == "lost" and "exited between jobs (status 3)" in ended["end_reason"]
    late = api.post("/api/v1/exec", json={"code": "1", "session": session["id"]})
    assert late.status_code == 410 and late.json()["error"]["code"] == "session_lost"


def test_another_users_session_is_404(make_api: Callable[..., Api]) -> None:
    owner, other = make_api(), make_api()
    session = _session(owner)
    assert other.get(f"/api/v1/sessions/{session['id']}").status_code == 404
    assert other.http.delete(f"/api/v1/sessions/{session['id']}").status_code == 404
    assert other.get(f"/api/v1/sessions/{session['id']}/files").status_code == 404
    assert other.post("/api/v1/exec", json={"code": "1", "session": session["id"]}).status_code == 404
    assert session["id"] not in [s["id"] for s in other.get("/api/v1/sessions").json()["results"]]
    # Staff see their own sessions only: a session is one user's sandbox.
    staff = make_api(staff=True)
    assert staff.get(f"/api/v1/sessions/{session['id']}").status_code == 404


def test_sessions_per_user_are_capped(make_api: Callable[..., Api]) -> None:
    api = make_api()
    made = [_session(api) for _ in range(4)]
    over = api.post("/api/v1/sessions", json={"toolsets": ["demo"]})
    assert over.status_code == 409 and over.json()["error"]["code"] == "too_many_sessions"
    api.http.delete(f"/api/v1/sessions/{made[0]['id']}")
    assert api.post("/api/v1/sessions", json={"toolsets": ["demo"]}).status_code == 201


def test_files_in_and_out_of_a_session(api: Api) -> None:
    session = _session(api)
    base = f"/api/v1/sessions/{session['id']}/files"
    up = api.post(base, files={"file": ("data.csv", b"a,b\n1,2\n")}, data={"path": "in/data.csv"})
    assert up.status_code == 201, up.text
    assert up.json()["pending"] is True and up.json()["size"] == 8
    job = _run(
        api,
        session,
        "rows = open('in/data.csv').read().splitlines()\n"
        "import os\nos.makedirs('out', exist_ok=True)\n"
        "open('out/result.txt', 'w').write(str(len(rows)))\n"
        "os.symlink('/etc/passwd', 'leak')\n"
        "rows",
    )
    assert job["status"] == "completed", job["error"]
    assert job["return_value"] == ["a,b", "1,2"]
    assert job["output_files"] == [{"path": "out/result.txt", "size": 1}]  # a symlink is never read
    listed = {f["path"]: f for f in api.get(base).json()["results"]}
    assert set(listed) == {"in/data.csv", "out/result.txt"}
    assert listed["in/data.csv"]["pending"] is False and listed["out/result.txt"]["kind"] == "output"
    got = api.get(f"{base}/out/result.txt")
    assert got.status_code == 200 and got.content == b"2"
    assert got.headers["content-type"] == "application/octet-stream"
    assert got.headers["content-disposition"] == 'attachment; filename="result.txt"'
    assert api.post(base, files={"file": ("x", b"cv")}, data={"path": 'r\u00e9sum\u00e9 "1".txt'}).status_code == 201
    named = api.get(f'{base}/r\u00e9sum\u00e9 "1".txt').headers["content-disposition"]
    assert named == "attachment; filename*=utf-8''r%C3%A9sum%C3%A9%20%221%22.txt"  # RFC 6266: readable by clients
    assert api.get(f"{base}/nope.txt").status_code == 404
    # The code removes a file: the session's copy goes too.
    assert _run(api, session, "import os\nos.remove('out/result.txt')")["status"] == "completed"
    assert {f["path"] for f in api.get(base).json()["results"]} == {"in/data.csv", 'r\u00e9sum\u00e9 "1".txt'}


@pytest.mark.parametrize("path", ["../escape.txt", "/etc/passwd", "a/../../b", "a//b", "./a", "a\x00b", "a\\b", ""])
def test_hostile_paths_are_400(api: Api, path: str) -> None:
    session = _session(api)
    if path:  # an upload without a path is stored under its file's name
        up = api.post(f"/api/v1/sessions/{session['id']}/files", files={"file": ("x", b"x")}, data={"path": path})
        assert up.status_code == 400, up.text
        # A form field with a NUL is refused by DRF's own field check, before the path's.
        assert up.json()["error"]["code"] == ("validation_error" if "\x00" in path else "invalid_path")
    inline = api.post("/api/v1/exec", json={"code": "1", "files": {path: "eA=="}})
    assert inline.status_code == 400 and inline.json()["error"]["code"] == "invalid_path"
    api.http.delete(f"/api/v1/sessions/{session['id']}")


def test_an_upload_is_never_written_through_a_symlink_the_code_made(api: Api) -> None:
    session = _session(api)
    base = f"/api/v1/sessions/{session['id']}/files"
    made = _run(api, session, "import os\nos.symlink('/tmp', 'outside')\nos.symlink('/tmp/target', 'link.txt')")
    assert made["status"] == "completed" and made["output_files"] == []
    for path in ("outside/planted.txt", "link.txt"):
        assert api.post(base, files={"file": ("x", b"planted")}, data={"path": path}).status_code == 201
        refused = _run(api, session, "import os\nsorted(os.listdir('/tmp'))")
        assert refused["status"] == "failed", refused
        assert refused["error"]["type"] == "InputFiles", refused["error"]
        assert f"the file '{path}' could not be written to /work" in refused["error"]["message"]
        assert api.http.delete(f"{base}/{path}").status_code == 204  # or it would go with every next job
    # Nothing reached /tmp, and the session goes on.
    assert _run(api, session, "import os\nsorted(os.listdir('/tmp'))")["return_value"] == []


def test_file_quotas_are_413(api: Api) -> None:
    session = _session(api)
    big = api.post(f"/api/v1/sessions/{session['id']}/files", files={"file": ("big", b"\0" * (9 << 20))})
    assert big.status_code == 413 and big.json()["error"]["code"] == "files_too_large"
    many = {f"f{i}.txt": "eA==" for i in range(101)}
    over = api.post("/api/v1/exec", json={"code": "1", "files": many})
    assert over.status_code == 413 and over.json()["error"]["code"] == "too_many_files"
    api.http.delete(f"/api/v1/sessions/{session['id']}")


def test_an_upload_of_many_parts_is_refused_in_the_apis_error_shape(api: Api) -> None:
    # Past Django's DATA_UPLOAD_MAX_NUMBER_FILES (100) or _FIELDS (1000) its form parser raises a
    # SuspiciousOperation, which went past the API's error handler: 400 with Django's HTML page.
    session = _session(api)
    url = f"/api/v1/sessions/{session['id']}/files"
    files = api.post(url, files=[("file", (f"f{i}", b"x")) for i in range(101)])
    fields = api.post(url, files={"file": ("a", b"x")}, data={f"k{i}": "v" for i in range(1001)})
    for refused in (files, fields):
        assert refused.status_code == 400, refused.text
        assert refused.headers["content-type"] == "application/json", refused.text
        error = refused.json()["error"]
        assert error["code"] == "validation_error" and "one file per upload" in error["message"], error
    assert api.get(url).json()["count"] == 0  # nothing was stored
    assert api.post(url, files={"file": ("a", b"x")}).status_code == 201  # the endpoint works on
    api.http.delete(f"/api/v1/sessions/{session['id']}")
    # Any other SuspiciousOperation, raised before a view (a Host not allowed), is in the shape too.
    host = api.get("/api/v1/sessions", headers={"Host": "evil.example"})
    assert host.status_code == 400 and host.json()["error"]["code"] == "validation_error", host.text
    assert "evil.example" in host.json()["error"]["message"] and not host.json()["error"]["message"].endswith("..")


def test_too_many_files_are_refused_for_their_count_at_once(api: Api) -> None:
    # The paths were checked against each other, every one with every other, before the count was:
    # 20,000 empty files (a 300 KB body) held the web process 30 s, for an answer the count gave.
    many = {f"f{i}": "" for i in range(20_000)}
    started = time.monotonic()
    over = api.post("/api/v1/exec", json={"code": "1", "files": many})
    assert over.status_code == 413 and over.json()["error"]["code"] == "too_many_files", over.text
    assert time.monotonic() - started < 3


def test_files_of_megabytes_come_back_whole(api: Api) -> None:
    """Far over one bridge frame's limit for a value: the files have their own quota."""
    code = "import hashlib, os\ndata = os.urandom(3 << 20)\nopen('big.bin', 'wb').write(data)\nhashlib.sha256(data).hexdigest()"
    session = _session(api)
    for job in (api.run(code), _run(api, session, code)):
        assert job["status"] == "completed", job["error"]
        assert job["output_files"] == [{"path": "big.bin", "size": 3 << 20}]
        where = f"/api/v1/sessions/{session['id']}" if job["session"] else f"/api/v1/exec/{job['id']}"
        got = api.get(f"{where}/files/big.bin")
        assert hashlib.sha256(got.content).hexdigest() == job["return_value"]


def test_a_large_upload_reaches_a_running_session(api: Api) -> None:
    session = _session(api)
    assert _run(api, session, "kept = 'yes'")["status"] == "completed"
    data = bytes(range(256)) * (7 << 12)  # 7 MiB: its start frame is over a tool result's limit
    assert api.post(f"/api/v1/sessions/{session['id']}/files", files={"file": ("blob.bin", data)}).status_code == 201
    job = _run(api, session, "import hashlib\n[kept, hashlib.sha256(open('blob.bin', 'rb').read()).hexdigest()]")
    assert job["status"] == "completed", job["error"]
    assert job["return_value"] == ["yes", hashlib.sha256(data).hexdigest()]


def test_files_over_the_quota_are_named_not_kept(api: Api) -> None:
    code = "open('small.txt', 'w').write('ok')\nopen('huge.bin', 'wb').write(bytes(9 << 20))"
    job = api.run(code)
    assert job["status"] == "completed", job["error"]
    assert job["output_files"] == [{"path": "small.txt", "size": 2}]
    assert job["output_files_omitted"] == ["huge.bin"]
    assert api.get(f"/api/v1/exec/{job['id']}/files/huge.bin").status_code == 404


def test_a_job_without_a_session_takes_and_returns_files(api: Api) -> None:
    files = {"input.txt": base64.b64encode(b"hello").decode()}
    job = api.run("text = open('input.txt').read()\nopen('upper.txt', 'w').write(text.upper())\ntext", files=files)
    assert job["status"] == "completed", job["error"]
    assert job["return_value"] == "hello"
    assert job["output_files"] == [{"path": "upper.txt", "size": 5}]
    got = api.get(f"/api/v1/exec/{job['id']}/files/upper.txt")
    assert got.status_code == 200 and got.content == b"HELLO"
    assert api.get(f"/api/v1/exec/{job['id']}/files/input.txt").status_code == 404  # given, not written


def test_the_readme_tour(api: Api) -> None:
    """The README's two-call session, as written there (with this test's key and server)."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme[readme.index("## Sessions") :]
    code = section[section.index("```python\n") + 10 : section.index("```", section.index("```python\n") + 10)]
    code = code.replace("http://127.0.0.1:8000", str(api.http.base_url).rstrip("/"))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(code, {"KEY": api.key})
    assert printed.getvalue() == "3 ['ring', '120'] [{'path': 'total.txt', 'size': 3}]\n420\n"


def test_admin_pages_for_sessions_and_files(api: Api) -> None:
    session = _session(api)
    api.post(f"/api/v1/sessions/{session['id']}/files", files={"file": ("seen.txt", b"admin")})
    assert _run(api, session, "open('made.txt', 'w').write('x')")["status"] == "completed"
    staff = get_user_model().objects.create_user(username=f"admin-{uuid.uuid4().hex[:6]}", is_staff=True, is_superuser=True)
    client = Client()
    client.force_login(staff)
    file_id = WorkFile.objects.get(session_id=session["id"], path="made.txt").pk
    for page in (
        "/admin/execution/execsession/",
        "/admin/execution/execsession/?status__exact=active",
        f"/admin/execution/execsession/{session['id']}/change/",
        "/admin/execution/workfile/",
        f"/admin/execution/workfile/{file_id}/change/",
    ):
        response = client.get(page)
        assert response.status_code == 200, page
    detail = client.get(f"/admin/execution/execsession/{session['id']}/change/").content.decode()
    assert "seen.txt" in detail and "made.txt" in detail


def test_a_bad_name_or_a_full_scan_of_work_loses_nothing(api: Api) -> None:
    session = _session(api)
    base = f"/api/v1/sessions/{session['id']}/files"
    assert api.post(base, files={"file": ("x", b"original")}, data={"path": "up.txt"}).status_code == 201
    # A name of bytes that are not UTF-8 can't be a stored file's: it is named among those left
    # out, and the job's other files (and the upload's delivery) are stored all the same.
    code = "import os\nopen('good.txt', 'w').write('good')\nos.close(os.open(b'bad\\xff.txt', os.O_WRONLY | os.O_CREAT))"
    job = _run(api, session, code)
    assert job["status"] == "completed", job["error"]
    assert (job["output_files"], job["output_files_omitted"]) == ([{"path": "good.txt", "size": 4}], ["bad?.txt"])
    edited = _run(api, session, "open('up.txt', 'w').write('edited')\nimport os\nos.remove(b'bad\\xff.txt')")
    assert edited["status"] == "completed", edited["error"]
    assert api.get(f"{base}/up.txt").content == b"edited"
    # More files than one scan of /work reads (10,000): those past it were not removed.
    many = _run(api, session, "for i in range(10_001):\n    open(f'a{i:05d}', 'w').close()")
    assert many["status"] == "completed", many["error"]
    assert api.get(f"{base}/good.txt").content == b"good" and api.get(f"{base}/up.txt").content == b"edited"


def test_an_upload_that_cant_be_written_is_refused_or_waits_named(api: Api) -> None:
    session = _session(api)
    base = f"/api/v1/sessions/{session['id']}/files"
    assert api.post(base, files={"file": ("x", b"y")}, data={"path": "dir/file.txt"}).status_code == 201
    two = api.post(base, files=[("file", ("a", b"1")), ("file", ("b", b"2"))])  # one would be dropped
    assert two.status_code == 400 and two.json()["error"]["message"] == "Send one file per upload.", two.text
    paths = api.post(base, files={"file": ("x", b"y")}, data={"path": ["keep/me.txt", "other.txt"]})
    assert paths.status_code == 400 and paths.json()["error"]["message"] == "Send one path per upload.", paths.text
    as_json = api.post(base, json={"path": "j.txt"})  # uploads are multipart only
    assert as_json.status_code == 415 and as_json.json()["error"]["code"] == "unsupported_media_type", as_json.text
    for path in ("n" * 256 + ".txt", "dir", "dir/file.txt/below"):  # a name past 255 bytes; a file and a folder of one name
        refused = api.post(base, files={"file": ("x", b"y")}, data={"path": path})
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_path", (path, refused.text)
    inline = api.post("/api/v1/exec", json={"code": "1", "files": {"a": "eA==", "a/b": "eA=="}})
    assert inline.status_code == 400 and "clashes with" in inline.json()["error"]["message"]
    # A folder the code made where an upload goes: the job ends InputFiles before its code runs,
    # naming it, and the uploads stay to be sent; once it is deleted, the session goes on.
    assert _run(api, session, "import os\nos.makedirs('made')")["status"] == "completed"
    assert api.post(base, files={"file": ("x", b"y")}, data={"path": "made"}).status_code == 201
    failed = _run(api, session, "ran = True")
    assert (failed["status"], failed["error"]["type"]) == ("failed", "InputFiles"), failed
    assert "'made' could not be written to /work (Is a directory)" in failed["error"]["message"]
    pending = {f["path"]: f["pending"] for f in api.get(base).json()["results"]}
    assert pending == {"dir/file.txt": False, "made": True}  # the former reached /work with the job before
    assert api.http.delete(f"{base}/made").status_code == 204
    delivered = api.http.delete(f"{base}/dir/file.txt")  # in /work already: the code removes it
    assert delivered.status_code == 409 and delivered.json()["error"]["code"] == "conflict"
    assert api.http.delete(f"{base}/made").status_code == 404
    after = _run(api, session, "import os\n[open('dir/file.txt').read(), os.path.isdir('made'), 'ran' in globals()]")
    assert after["return_value"] == ["y", True, False], after


def test_an_upload_while_a_job_runs_is_newer_than_what_the_job_wrote(api: Api) -> None:
    session = _session(api)
    code = "import time\nopen('w.txt', 'w').write('code')\ntime.sleep(2.5)"
    job = api.post("/api/v1/exec", json={"code": code, "session": session["id"], "wait": 0}).json()
    _until(api, f"/api/v1/exec/{job['id']}", lambda j: j["status"] == "running")
    time.sleep(0.5)  # the code has written w.txt, and sleeps
    base = f"/api/v1/sessions/{session['id']}/files"
    assert api.post(base, files={"file": ("x", b"upload")}, data={"path": "w.txt"}).status_code == 201
    ended = _until(api, f"/api/v1/exec/{job['id']}", lambda j: j["status"] != "running")
    assert ended["status"] == "completed" and ended["output_files"] == [], ended
    [row] = api.get(base).json()["results"]
    assert (row["path"], row["kind"], row["pending"]) == ("w.txt", "input", True)
    assert api.get(f"{base}/w.txt").content == b"upload"
    assert _run(api, session, "open('w.txt').read()")["return_value"] == "upload"


def test_a_session_past_its_time_reads_expired_before_the_reaper_records_it(api: Api) -> None:
    from execution.models import ExecSession
    from execution.serializers import SessionSerializer

    session = ExecSession.objects.get(pk=_session(api, idle_timeout=600)["id"])
    session.expires_at = session.last_used_at  # as if its idle_timeout had passed; still active in the database
    shown = SessionSerializer(session).data
    assert (shown["status"], shown["end_reason"]) == ("expired", "it was idle for its idle_timeout of 600 s")
    assert session.status == "active"
    api.http.delete(f"/api/v1/sessions/{session.pk}")


def test_a_job_its_sessions_end_left_queued_fails_at_the_reapers_next_round(api: Api) -> None:
    """A session's end fails its jobs still queued (SessionEnded) after the UPDATE that ends it,
    which is committed on its own. Cut short there (here the reaper's fail is cancelled on the job's
    row, held locked by a stuck transaction), the job stayed queued in a session that was over, its
    message on the queue of a worker that may be gone, until PTC_QUEUED_MAX_SECONDS (half an hour):
    a client waiting on it, or polling, saw it queued all that while. Now the reaper's next round
    after its row is free fails it, says why its session ended, and announces its end."""
    from execution.models import ExecJob, ExecSession
    from execution.services.sessions import exec_sessions_reap
    from ptcproject.db import pg_connect
    from tests.execution.test_job_end import _logged_ends
    from tests.factories import running_job

    session = ExecSession.objects.get(pk=_session(api, idle_timeout=600)["id"])
    # Queued on the queue of a worker that no longer reads it: nothing here takes it.
    job = running_job(user=session.user, session=session, status="queued")
    ExecSession.objects.filter(pk=session.pk).update(current_job=job)
    with pg_connect() as holder:
        holder.execute("SELECT 1 FROM execution_execjob WHERE id = %s FOR UPDATE", [job.pk])
        ExecSession.objects.filter(pk=session.pk).update(expires_at=session.last_used_at)  # its idle_timeout passed
        exec_sessions_reap()  # the stack's reaper may be first: either is cancelled on the job's row
        assert ExecSession.objects.get(pk=session.pk).status == "expired"
        assert ExecJob.objects.get(pk=job.pk).status == "queued"
    ended = _until(api, f"/api/v1/exec/{job.pk}", lambda job: job["status"] != "queued", seconds=10)
    assert (ended["status"], ended["error"]["type"]) == ("failed", "SessionEnded"), ended
    assert ended["error"]["message"] == "its session ended before it started: it was idle for its idle_timeout of 600 s"
    assert [end["status"] for end in _logged_ends(job.call_id)] == ["failed"]


def test_a_job_its_worker_takes_after_its_session_ended_never_runs_there(api: Api) -> None:
    """The worker holding a session's sandbox ran a job it took there whatever the state of the
    session read with the claim: one deleted as the job was queued (its end's fail of the job cut
    short, the reaper's next round too late for a message already on that worker's queue), or, as
    here, one past its max_lifetime that the reaper could not record yet (its row held locked: the
    sandbox is killed only once it is). The code ran in a session that was over. Now such a job
    fails SessionEnded, saying why, and its code never runs."""
    from celery.utils.nodenames import worker_direct
    from django.utils import timezone

    from execution.models import ExecJob, ExecSession
    from execution.services import jobs
    from execution.services.sessions import session_limits
    from execution.tasks import run_exec
    from ptcproject.celery import task_publish
    from ptcproject.db import pg_connect
    from tests.conftest import REDIS_PREFIX

    made = _session(api, idle_timeout=600, max_lifetime=600)
    assert _run(api, made, "1")["status"] == "completed"  # its sandbox is held by a worker now
    session = ExecSession.objects.get(pk=made["id"])
    limits = session_limits(session=session, job=jobs.job_limits(policy=jobs.policy_get(), timeout=30)).as_dict()
    job = ExecJob.objects.create(
        user=session.user, code="print('ran')", toolsets=["demo"], timeout_seconds=30, limits=limits, session=session
    )
    over = timezone.now() + timedelta(seconds=0.5)  # its max_lifetime, reached once its row is held
    ExecSession.objects.filter(pk=session.pk).update(current_job=job, expires_at=over, max_expires_at=over)
    with pg_connect() as holder:
        holder.execute("SELECT 1 FROM execution_execsession WHERE id = %s FOR UPDATE", [session.pk])
        time.sleep(max((over - timezone.now()).total_seconds(), 0) + 0.2)
        # To the holder's queue, as the session's jobs go (the stack's keys are under its own prefix).
        with run_exec.app.connection_for_write(transport_options={"global_keyprefix": REDIS_PREFIX}) as connection:
            task_publish(run_exec, connection.Producer(), (str(job.pk),), queue=worker_direct(session.worker).name)
        _until(api, f"/api/v1/exec/{job.pk}", lambda job: job["status"] != "queued")  # taken by its worker
        time.sleep(1)  # the code, if sent, has run
        assert ExecSession.objects.get(pk=session.pk).status == "active"  # the reaper could not record its end
    ended = _until(api, f"/api/v1/exec/{job.pk}", lambda job: job["status"] not in ("queued", "running"))
    assert (ended["status"], (ended["error"] or {}).get("type"), ended["stdout"]) == ("failed", "SessionEnded", ""), ended
    assert ended["error"]["message"] == "its session ended before it started: it reached its max_lifetime of 600 s"
