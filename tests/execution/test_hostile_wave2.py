"""Hostile clients of sessions, client tools and approvals, second wave: real workers, real HTTP."""

import json
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from typing import Any

from django.db import transaction
from django.utils import timezone

from tests.conftest import Api
from tests.execution.client_loop import sse_events
from tests.execution.rival import _a_statement_waits_for_a_lock
from tests.stack import Stack, peak_mb, peak_reset


def _submit(api: Api, code: str, names: list[str]) -> dict[str, Any]:
    tools = [{"name": name, "input_schema": {"type": "object", "properties": {"n": {"type": "integer"}}}} for name in names]
    response = api.post("/api/v1/exec", json={"code": code, "client_tools": tools, "wait": 0})
    assert response.status_code == 201, response.text
    return response.json()


def _pending(api: Api, job_id: str, count: int) -> list[str]:
    """The ids of the job's first ``count`` calls waiting on the client, as its stream sends them."""
    ids: list[str] = []
    with closing(sse_events(api, job_id)) as events:
        for event, data in events:
            if event == "tool_call_pending":
                ids.append(data["id"])
                if len(ids) == count:
                    return ids
    raise AssertionError(f"the job ended with {len(ids)} pending calls")


TWO_WAITING = """
from concurrent.futures import ThreadPoolExecutor
from ptc_tools.client import Client
with ThreadPoolExecutor(2) as pool:
    out = list(pool.map(lambda i: Client.wait(n=i), [1, 2]))
out
"""


def test_two_batches_answering_the_same_calls_in_other_orders_do_not_deadlock(api: Api) -> None:
    # Two clients answer calls a and b at once, one as [a, b], the other as [b, a]. Each claims its
    # calls one row at a time in one transaction: in the order given, each held the row the other
    # waited for, PostgreSQL broke the deadlock by failing one, and its client got a 503
    # database_unavailable (after a second's wait) for what is a second answer: 409.
    from execution.models import ToolCall

    job = _submit(api, TWO_WAITING, ["wait"])
    first, second = sorted(_pending(api, job["id"], 2))
    url = f"/api/v1/exec/{job['id']}/tool-results"
    answered = {"status": ToolCall.Status.COMPLETED, "output": "rival", "claimed_at": timezone.now()}
    with ThreadPoolExecutor(1) as pool, transaction.atomic():
        # The rival answer [first, second] has claimed its first call, not committed yet.
        assert ToolCall.objects.filter(call_id=first).update(**answered) == 1
        body = [{"tool_use_id": second, "content": "late"}, {"tool_use_id": first, "content": "late"}]
        late = pool.submit(lambda: api.post(url, json=body))
        deadline = time.monotonic() + 15
        while not _a_statement_waits_for_a_lock():
            assert not late.done(), late.result().text
            assert time.monotonic() < deadline, "the late answer never waited for the rival's row"
            time.sleep(0.02)
        # The rival goes on to its second call and commits.
        assert ToolCall.objects.filter(call_id=second).update(**answered) == 1
    response = late.result()
    assert response.status_code == 409, response.text
    assert response.json()["error"]["code"] == "result_conflict"
    final = api.get(f"/api/v1/exec/{job['id']}").json()
    assert [c["output"] for c in final["tool_calls"]] == ["rival", "rival"]
    assert api.post(f"/api/v1/exec/{job['id']}/cancel").status_code in (200, 409)


def test_listing_sessions_by_status_goes_by_the_status_each_one_shows(api: Api) -> None:
    # A session past its time reads expired (GET, and in the list) before the reaper records it; the
    # ?status= filter went by the recorded status, so ?status=active listed it, shown expired, and
    # ?status=expired left it out.
    from execution.models import ExecSession

    made = [api.post("/api/v1/sessions", json={"toolsets": ["demo"]}).json()["id"] for _ in range(2)]
    idle, live = made
    ExecSession.objects.filter(pk=idle).update(expires_at=timezone.now())  # its idle_timeout passed; not reaped
    listed = {
        status: {s["id"]: s["status"] for s in api.get(f"/api/v1/sessions?status={status}").json()["results"]}
        for status in ("active", "expired")
    }
    assert listed == {"active": {live: "active"}, "expired": {idle: "expired"}}
    for session_id in made:
        api.http.delete(f"/api/v1/sessions/{session_id}")


def test_retention_purges_the_files_of_an_ended_session(api: Api) -> None:
    # A purged job's files go with it, but a session's are the session's: once it ended (expired,
    # lost), what was uploaded to it and what its code wrote stayed for ever, whatever its owner's
    # retention, and a user could pile up PTC_FILES_MAX_BYTES a session, session after session.
    from django.contrib.auth import get_user_model

    from execution.models import ExecSession, WorkFile
    from ptcproject.accounts.models import UserSettings

    UserSettings.objects.create(user=get_user_model().objects.get(username=api.username), retention_days=0)
    session = api.post("/api/v1/sessions", json={"toolsets": ["demo"], "idle_timeout": 1}).json()
    base = f"/api/v1/sessions/{session['id']}/files"
    assert api.post(base, files={"file": ("upload.txt", b"private upload")}).status_code == 201
    job = api.run("open('wrote.txt', 'w').write(open('upload.txt').read().upper())", session=session["id"])
    assert job["status"] == "completed", job["error"]
    assert api.get(f"{base}/wrote.txt").content == b"PRIVATE UPLOAD"
    deadline = time.monotonic() + 20
    while WorkFile.objects.filter(session_id=session["id"]).exists():  # the reaper's, then beat's round: every second here
        assert time.monotonic() < deadline, "the ended session's files were kept past its owner's retention"
        time.sleep(0.2)
    assert ExecSession.objects.get(pk=session["id"]).status == "expired"
    assert api.get(base).json()["results"] == []
    assert api.get(f"{base}/wrote.txt").status_code == 404


def test_a_session_past_its_time_holds_no_place_in_the_jobs_at_once_quota(api: Api) -> None:
    # An open session counts as a job against max_concurrent_jobs. One past its idle_timeout reads
    # expired (and a job in it is 410) before the reaper records it, yet it still held its place:
    # the user's next job was 429 "sessions open" until the reaper's round (PTC_REAP_EVERY, 15 s).
    from django.contrib.auth import get_user_model

    from execution.models import ExecSession
    from ptcproject.accounts.models import UserSettings

    UserSettings.objects.create(user=get_user_model().objects.get(username=api.username), max_concurrent_jobs=1)
    session = api.post("/api/v1/sessions", json={"toolsets": ["demo"]}).json()
    ExecSession.objects.filter(pk=session["id"]).update(expires_at=timezone.now())  # its idle_timeout passed; not reaped
    assert api.get(f"/api/v1/sessions/{session['id']}").json()["status"] == "expired"
    response = api.post("/api/v1/exec", json={"code": "1", "wait": 0})
    assert response.status_code == 201, response.text
    api.http.delete(f"/api/v1/sessions/{session['id']}")


def test_a_page_of_heavy_jobs_is_sent_as_it_is_read(stack: Stack, api: Api) -> None:
    # A list page was built whole before a byte of it was sent: every job with every call's input
    # and output (up to PTC_MAX_JOB_TOOL_BYTES each), 50 jobs a page by default and up to 500, so one
    # user's own records could make the web hold tens of gigabytes. A page is now written as it is
    # read, a job at a time, and the client gets the same page.
    from django.contrib.auth import get_user_model

    from execution.models import ToolCall
    from tests.factories import demo_call, running_job

    user = get_user_model().objects.get(username=api.username)
    payload = "x" * (1 << 20)
    jobs = [running_job(user=user, status="completed") for _ in range(40)]
    for job in jobs:  # 4 MiB of outputs each: 160 MiB in the page
        for _ in range(4):
            demo_call(user=user, job=job, status=ToolCall.Status.COMPLETED, output=payload)
    assert stack.web.proc is not None
    pid = stack.web.proc.pid
    before = peak_reset(pid)
    with api.http.stream("GET", "/api/v1/exec?page_size=50") as response:
        assert response.status_code == 200
        body = b"".join(response.iter_bytes())
    risen = peak_mb(pid) - before
    page = json.loads(body)
    assert page["count"] == 40 and page["next"] is None and page["previous"] is None
    assert [job["id"] for job in page["results"]] == [str(job.pk) for job in reversed(jobs)]  # newest first
    assert all(len(job["tool_calls"]) == 4 and job["tool_calls"][0]["output"] == payload for job in page["results"])
    # Built whole, the page took about three times its size (480 MiB here); a job at a time, a fraction of it.
    assert risen < 160, f"the web's resident size rose {risen} MiB while it sent a 160 MiB page"


def test_a_client_that_stops_reading_a_page_holds_no_database_connection(stack_env: dict[str, str], tmp_path: Any) -> None:
    # A page is sent as it is read, so it takes as long as its client takes to read it. Each part
    # was made on the request's thread with its database connection held from one part to the
    # next, for as long as the client took: a pool's worth of clients that stop reading (a slow
    # link; one user's scripts) held every connection of the web's pool, and every other request
    # waited PTC_DB_POOL_TIMEOUT and answered 503 database_unavailable.
    import socket
    from urllib.parse import urlsplit

    import httpx

    from execution.models import ToolCall
    from ptcproject.accounts.services import user_with_key_create
    from tests.factories import demo_call, running_job
    from tests.stack import free_port

    env = {**stack_env, "PTC_DB_POOL_MIN": "1", "PTC_DB_POOL_MAX": "2", "PTC_DB_POOL_TIMEOUT": "2"}
    stack = Stack(env, name="small-pool")
    user, key = user_with_key_create(username=f"slow-{free_port()}", create_user=True, staff=False, credits=100)
    payload = "x" * (1 << 20)
    for _job in range(12):  # 2 MiB each: 24 MiB in the page, far past what the sockets buffer
        job = running_job(user=user, status="completed")
        for _call in range(2):
            demo_call(user=user, job=job, status=ToolCall.Status.COMPLETED, output=payload)
    host, port = urlsplit(stack.base_url).hostname, urlsplit(stack.base_url).port
    stalled: list[socket.socket] = []
    try:
        stack.start(beat=False)
        for _reader in range(2):  # as many as the pool holds
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect((host, port))
            sock.sendall(
                f"GET /api/v1/exec?page_size=50 HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n\r\n".encode()
            )
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")  # and then it reads no more
            stalled.append(sock)
        time.sleep(1)
        with httpx.Client(base_url=stack.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=30) as http:
            other = http.get("/api/v1/keys")
        assert other.status_code == 200, other.text
    finally:
        for sock in stalled:
            sock.close()
        stack.stop()


def test_a_heavy_jobs_view_is_sent_as_it_is_read(stack: Stack, api: Api) -> None:
    # A job's own view (GET, the cancel's answer, POST's after a wait, a list page's job) was built
    # whole, every call's input and output in it, before a byte was sent: about three times its
    # size per request, and a job may carry PTC_MAX_JOB_TOOL_BYTES (a managed container's job ran
    # without any bound). Its calls are now read and written a few at a time.
    from django.contrib.auth import get_user_model
    from rest_framework.renderers import JSONRenderer

    from execution.events import job_view
    from execution.selectors import exec_job_with_calls
    from tests.factories import job_calls, running_job

    user = get_user_model().objects.get(username=api.username)
    job = running_job(user=user)
    job_calls(job, [{"output": f"{i}" + "x" * (1 << 20), "started_at": timezone.now()} for i in range(160)])
    whole = json.loads(JSONRenderer().render(job_view(exec_job_with_calls(job_id=job.pk))))
    assert whole["credits_charged"] == 160 and len(whole["tool_calls"]) == 160
    assert stack.web.proc is not None
    pid = stack.web.proc.pid
    for method, path in [
        ("GET", f"/api/v1/exec/{job.pk}"),
        ("GET", "/api/v1/exec?page_size=1"),
        ("POST", f"/api/v1/exec/{job.pk}/cancel"),
    ]:
        before = peak_reset(pid)
        with api.http.stream(method, path) as response:
            assert response.status_code == 200, response.read()[:300]
            body = json.loads(b"".join(response.iter_bytes()))
        risen = peak_mb(pid) - before
        view = body["results"][0] if "results" in body else body
        if method == "POST":  # cancelled since
            assert (view["status"], view["finished_at"] is not None) == ("cancelled", True)
            whole |= {name: view[name] for name in ("status", "success", "finished_at", "error", "execution_time_seconds")}
        assert view == whole
        # Built whole, 160 MiB of calls took about 480 MiB; a few calls at a time, a fraction of it.
        assert risen < 100, f"the web's resident size rose {risen} MiB while it sent {method} {path}, a 160 MiB job"
