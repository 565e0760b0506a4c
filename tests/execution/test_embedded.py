"""The embedded default (SQLite, the filesystem broker, no Redis): jobs, tool calls and SSE events from a log file."""

import asyncio
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from django.contrib.auth import get_user_model
from django.utils import timezone

from execution import events
from execution.backplane import OUTCOME_KEPT_SECONDS, Changed, LocalBackplane, Result, job_channel
from execution.models import ExecJob
from tests.execution.test_events import JOB, _check_sequence, read_events
from tests.factories import running_job
from tests.stack import ROOT, Stack


@pytest.fixture(scope="module")
def embedded(tmp_path_factory: pytest.TempPathFactory, stack_env: dict[str, str]) -> Iterator[tuple[Stack, str]]:
    data = tmp_path_factory.mktemp("embedded")
    env = {k: v for k, v in stack_env.items() if k not in ("DATABASE_URL", "CELERY_BROKER_URL", "REDIS_URL", "PTC_REDIS_PREFIX")}
    env["PTC_DATA_DIR"] = str(data)
    subprocess.run([sys.executable, "manage.py", "migrate", "-v0"], cwd=ROOT, env=env, check=True)
    key = subprocess.run(
        [sys.executable, "manage.py", "create_api_key", "embedded", "--create-user", "--credits", "100"],
        cwd=ROOT,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.splitlines()[-1]
    stack = Stack(env, name="embedded")
    stack.start(beat=False)
    try:
        yield stack, key
    finally:
        stack.stop()


class _Client:
    def __init__(self, base_url: str, key: str) -> None:
        self.http = httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def test_embedded_jobs_and_their_event_log(embedded: tuple[Stack, str]) -> None:
    """Live, the embedded log carries what the code prints as it prints it, and a reconnect from any
    event's id gets exactly the events after it (ids are offsets in the job's log file)."""
    stack, key = embedded
    client = _Client(stack.base_url, key)
    response = client.http.post("/api/v1/exec", json={"code": JOB, "toolsets": ["demo"], "wait": 0})
    assert response.status_code == 201
    job_id = response.json()["id"]
    events, _ = read_events(client, job_id)  # type: ignore[arg-type]
    job = client.http.get(f"/api/v1/exec/{job_id}").json()
    assert job["status"] == "completed", job["error"]
    assert job["credits_charged"] == 4
    _check_sequence(events, job, with_output=True)
    assert Path(stack.env["PTC_DATA_DIR"], "db.sqlite3").exists()
    assert Path(stack.env["PTC_DATA_DIR"], "events", f"{job['call_id']}.log").exists()
    for at, event in enumerate(events[:-1]):
        resumed, _ = read_events(client, job_id, last_event_id=event["id"])  # type: ignore[arg-type]
        assert resumed == events[at + 1 :], f"resumed after event {at} ({event['event']})"
    after_end, _ = read_events(client, job_id, last_event_id=events[-1]["id"])  # type: ignore[arg-type]
    assert after_end == []


def test_embedded_serves_mcp_over_http_and_stdio(embedded: tuple[Stack, str]) -> None:
    """/mcp and ptc_mcp on the embedded default: progress comes from the job's log file, woken by its channel."""
    from tests.execution.test_mcp_server import call, http_client, run, stdio_client

    stack, key = embedded
    code = "from ptc_tools.demo import Demo\nDemo.add(a=1, b=2)"
    progress: list[str] = []

    async def on_progress(value: float, total: float | None, message: str | None) -> None:
        progress.append(message or "")

    async def main() -> tuple[dict, dict]:
        async with http_client(stack, key) as client:
            over_http = await call(client, "exec_code", {"code": code, "toolsets": ["demo"]}, progress_callback=on_progress)
        async with stdio_client(stack.env, "embedded") as client:
            over_stdio = await call(client, "programmatic_tool_calling", {"code": code})
        return over_http, over_stdio

    over_http, over_stdio = run(main)
    assert over_http["status"] == "completed" and over_http["return_value"] == 3
    assert any(m.startswith("tool call finished: demo.add") for m in progress)
    assert over_stdio["success"] is True and over_stdio["return_value"] == 3


def test_embedded_sessions_route_to_their_worker(embedded: tuple[Stack, str]) -> None:
    """A session on the filesystem broker: its later jobs reach its worker's direct queue."""
    stack, key = embedded
    client = _Client(stack.base_url, key)
    session = client.http.post("/api/v1/sessions", json={"toolsets": ["demo"]}).json()
    values = []
    for code in ("n = 40", "n += 1", "n + 1"):
        job = client.http.post("/api/v1/exec", json={"code": code, "session": session["id"], "wait": 30}).json()
        assert job["status"] == "completed", job["error"]
        values.append(job["return_value"])
    assert values == [None, None, 42]
    assert client.http.delete(f"/api/v1/sessions/{session['id']}").json()["status"] == "deleted"


def _channel_folders(stack: Stack) -> set[str]:
    """The channels' folders of the embedded stack's backplane (one a channel, under the temp dir)."""
    env = {**stack.env, "DJANGO_SETTINGS_MODULE": "ptcproject.settings"}
    code = "import django; django.setup(); from execution.backplane import _socket_dir; print(_socket_dir('x').parent)"
    root = Path(
        subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True, capture_output=True, text=True).stdout.strip()
    )
    return {p.name for p in root.iterdir()} if root.is_dir() else set()


def test_embedded_channels_leave_no_folders_behind(embedded: tuple[Stack, str]) -> None:
    """Each job's channels (its own, its end's) are folders of sockets: gone with their last subscriber."""
    stack, key = embedded
    client = _Client(stack.base_url, key)
    before = _channel_folders(stack)
    for _ in range(5):
        job = client.http.post("/api/v1/exec", json={"code": JOB, "toolsets": ["demo"], "wait": 30}).json()
        assert job["status"] == "completed", job["error"]
        read_events(client, job["id"])  # type: ignore[arg-type]
    deadline = time.monotonic() + 10
    while (left := _channel_folders(stack) - before) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"{len(left)} channel folders left behind by 5 jobs"


KEY_HOLDER = """
import time
from ptc_tools import _runtime
from ptc_tools.demo import Demo
Demo.echo(value=_runtime.job_info["key"])
time.sleep(2)
threads = [__import__("threading").Thread(target=Demo.sleep, kwargs={"ms": 300}) for _ in range(3)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
"""


def test_embedded_a_jobs_calls_over_http_with_its_key_are_admitted_by_its_bridge(embedded: tuple[Stack, str]) -> None:
    """Its bridge admits a call over HTTP with the job's key over the embedded channels (unix
    sockets) as over Redis: the call runs, counted with the code's, and leaves no channel behind."""
    stack, key = embedded
    client = _Client(stack.base_url, key)
    before = _channel_folders(stack)
    job = client.http.post("/api/v1/exec", json={"code": KEY_HOLDER, "toolsets": ["demo"], "wait": 0}).json()
    deadline = time.monotonic() + 20
    while not (calls := client.http.get("/api/v1/tool-calls", params={"exec": job["id"]}).json()["results"]):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    scoped = httpx.Client(base_url=stack.base_url, headers={"Authorization": f"Bearer {calls[0]['input']['value']}"}, timeout=30)
    with scoped:
        body = {"toolset": "demo", "tool": "add", "arguments": {"a": 2, "b": 3}}
        made = scoped.post("/api/v1/tools/execute", json=body, headers={"x-ptc-call-id": job["call_id"]})
    assert (made.status_code, made.json()["output"]) == (200, 5), made.text
    while (final := client.http.get(f"/api/v1/exec/{job['id']}").json())["status"] == "running":
        assert time.monotonic() < deadline + 20
        time.sleep(0.2)
    assert final["status"] == "completed", final["error"]
    assert [c["tool"] for c in final["tool_calls"]][:2] == ["echo", "add"] and len(final["tool_calls"]) == 5
    while (left := _channel_folders(stack) - before) and time.monotonic() < deadline + 30:
        time.sleep(0.2)
    assert not left, f"{len(left)} channel folders left behind"


@pytest.fixture
def plane(tmp_path: Path, settings: Any, monkeypatch: pytest.MonkeyPatch) -> LocalBackplane:
    """The embedded backplane in this process, its logs under ``tmp_path``: the one event streams read."""
    settings.DATA_DIR = tmp_path
    plane = LocalBackplane()
    monkeypatch.setattr(events, "backplane", lambda: plane)
    return plane


def test_embedded_log_skips_a_torn_line_and_gets_a_lost_end_from_the_records(tmp_path: Path, plane: LocalBackplane) -> None:
    """A job that ended long enough ago with no ``exec_end`` in its log (its worker died as it
    appended it) has it appended from its records by its reader; a line cut short is skipped."""
    user = get_user_model().objects.create_user(username=f"torn-{uuid.uuid4().hex[:6]}")
    closed = timezone.now() - timedelta(seconds=events.END_LOST_SECONDS + 5)
    job = running_job(user=user, status="completed", started_at=closed, finished_at=closed, stdout="hi\n")
    plane.events_append(job.call_id, [("exec_start", {"id": str(job.pk)})])
    with open(tmp_path / "events" / f"{job.call_id}.log", "ab") as log:
        log.write(b'stdout\t{"text":')  # torn: the next append goes on after it, on the same line
    plane.events_append(job.call_id, [("stdout", {"text": "hi\n"})])

    async def read(last_event_id: str | None = None) -> list[events.Event]:
        stream = events.event_stream(job_id=job.pk, last_event_id=last_event_id)
        return [event async for event in stream if event is not None]

    got = asyncio.run(read())
    assert [e.event for e in got] == ["exec_start", "exec_end"]
    assert got[-1].data["stdout"] == "hi\n" and got[-1].data["status"] == "completed"
    assert [e.event for e in asyncio.run(read(got[0].id))] == ["exec_end"]
    assert asyncio.run(read(got[-1].id)) == []  # appended once: a reconnect after it ends at once


def test_embedded_log_gets_a_closed_calls_end_once_and_no_log_is_made_for_it(tmp_path: Path, plane: LocalBackplane) -> None:
    """A call found closed by a try that may have closed itself (its finish's reply lost after the
    commit) has its end appended to its job's log unless the log has it; a log that has expired,
    whose readers take the records, is not made again for it."""
    job_call_id, call_id = f"exec_{uuid.uuid4().hex}", f"ptc_{uuid.uuid4().hex}"
    end = ("tool_call_end", {"call_id": call_id, "output": 3})
    plane.call_end_push([], job_call_id=job_call_id, call_id=call_id, end=end)
    assert not (tmp_path / "events" / f"{job_call_id}.log").exists()
    plane.events_append(job_call_id, [("tool_call_start", {"call_id": call_id}), ("tool_call_end", {"call_id": "ptc_other"})])
    for _ in range(2):
        plane.call_end_push([], job_call_id=job_call_id, call_id=call_id, end=end)
    logged = [(name, data["call_id"]) for _, name, data in plane.events_read(job_call_id)]
    assert logged == [("tool_call_start", call_id), ("tool_call_end", "ptc_other"), ("tool_call_end", call_id)]


def test_embedded_outcomes_kept_are_read_back_until_dropped_or_expired(tmp_path: Path, plane: LocalBackplane) -> None:
    """An outcome the database did not take through all of a call's task's retries is kept in the
    data folder for the reaper: read back until it is dropped (recorded), or a day old (as Redis's
    key expires); a call id that is no file name is kept under one of its own making."""
    assert plane.outcome_keep("ptc_a", "signed-a") and plane.outcome_keep("../b", "signed-b")
    assert plane.outcomes_kept(["ptc_a", "../b", "ptc_c"]) == {"ptc_a": "signed-a", "../b": "signed-b"}
    assert {path.parent for path in tmp_path.rglob("*") if path.is_file()} == {tmp_path / "outcomes"}
    plane.outcomes_drop(["ptc_a"])
    aged = time.time() - OUTCOME_KEPT_SECONDS - 60
    for path in (tmp_path / "outcomes").iterdir():
        os.utime(path, (aged, aged))
    assert plane.outcomes_kept(["ptc_a", "../b"]) == {}
    assert list((tmp_path / "outcomes").iterdir()) == []


def test_embedded_followers_waiting_hold_no_thread(settings: Any, plane: LocalBackplane) -> None:
    """Followers waiting for a job's next event wait on the event loop: a dozen of them, on a
    quiet job, do not hold up another follower's reads for a heartbeat's interval (the loop's
    pool of threads, which those reads use, has the cores + 4)."""
    settings.PTC_EVENTS_HEARTBEAT_SECONDS = 5
    user = get_user_model().objects.create_user(username=f"quiet-{uuid.uuid4().hex[:6]}")
    now = timezone.now()
    quiet = running_job(user=user, started_at=now, heartbeat_at=now)
    done = running_job(user=user, status="completed", started_at=now, finished_at=now)
    plane.events_append(done.call_id, [("exec_start", {"id": str(done.pk)}), ("exec_end", {"status": "completed"})])

    async def main() -> tuple[list[str], float]:
        waiting = [asyncio.create_task(anext(events.event_stream(job_id=quiet.pk))) for _ in range(12)]
        await asyncio.sleep(0.5)  # each is waiting for the quiet job's log
        started = time.monotonic()
        got = [event.event async for event in events.event_stream(job_id=done.pk) if event is not None]
        took = time.monotonic() - started
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        return got, took

    got, took = asyncio.run(main())
    assert got == ["exec_start", "exec_end"]
    assert took < 2, f"a follower's reads waited {took:.1f} s behind followers of a quiet job"


def test_embedded_resume_from_an_id_the_log_never_gave(embedded: tuple[Stack, str]) -> None:
    """An event's id is an offset in its job's log, and a client may send any id: one in the middle
    of a line read the line's tail as an event (``c_start``, named from ``exec_start`` cut), and one
    past what the file system seeks to cut the stream with a traceback (EventSource reconnects with
    it every second). As on Redis, the events after an id are those whose ids are greater."""
    stack, key = embedded
    client = _Client(stack.base_url, key)
    job = client.http.post("/api/v1/exec", json={"code": "print('hi')", "toolsets": ["demo"], "wait": 30}).json()
    events, _ = read_events(client, job["id"])
    assert [e["event"] for e in events] == ["exec_start", "stdout", "exec_end"], events
    for at, event in enumerate(events):
        inside = f"{int(event['id'].split('-')[0]) - 3}-0"  # in the event's line, before its end
        resumed, _ = read_events(client, job["id"], last_event_id=inside)
        assert resumed == events[at:], f"resumed from inside event {at} ({event['event']})"
    for beyond in ("4611686018427387904-0", "18446744073709551615-0"):
        assert read_events(client, job["id"], last_event_id=beyond)[0] == []


def test_embedded_log_expired_gives_a_reader_of_it_the_end_not_the_history_again(settings: Any, plane: LocalBackplane) -> None:
    """The log's ids are offsets in its file, the records' are times, so every id of the log is
    less than any the records give: once the log is dropped (beat's sweep, an hour idle; or a purge
    as it was read), a reader resuming from an id of it (EventSource left open on an ended job
    reconnects every second), or one reading it as it went, was sent the job's whole history again
    from the records. It gets the job's end: the records can't tell which events it had."""
    settings.PTC_EVENTS_HEARTBEAT_SECONDS = 0.3
    user = get_user_model().objects.create_user(username=f"gone-{uuid.uuid4().hex[:6]}")
    started = timezone.now() - timedelta(seconds=30)
    job = running_job(user=user, status="completed", started_at=started, finished_at=started, stdout="hi\n")
    plane.events_append(job.call_id, [("exec_start", events.job_start_payload(job)), ("stdout", {"text": "hi\n"})])
    plane.events_append(job.call_id, [("exec_end", {"status": "completed"})])

    async def read(last_event_id: str | None = None) -> list[events.Event]:
        stream = events.event_stream(job_id=job.pk, last_event_id=last_event_id)
        return [event async for event in stream if event is not None]

    logged = asyncio.run(read())
    assert [e.event for e in logged] == ["exec_start", "stdout", "exec_end"]
    plane.events_drop([job.call_id])
    resumed = asyncio.run(read(logged[1].id))
    assert [e.event for e in resumed] == ["exec_end"] and resumed[0].data["stdout"] == "hi\n"
    assert asyncio.run(read(resumed[0].id)) == []  # an id of the records: after it, nothing
    assert [e.event for e in asyncio.run(read())] == ["exec_start", "exec_end"]  # from the start: all of it

    # A reader of a running job whose log goes as the job ends (its end a records' one).
    running = running_job(user=user, started_at=started)
    plane.events_append(running.call_id, [("exec_start", events.job_start_payload(running))])

    async def follow() -> list[str]:
        names = []
        async for event in events.event_stream(job_id=running.pk):
            if event is not None:
                names.append(event.event)
            if event is not None and event.event == "exec_start":
                await asyncio.to_thread(plane.events_drop, [running.call_id])
                await asyncio.to_thread(
                    ExecJob.objects.filter(pk=running.pk).update, status="completed", finished_at=timezone.now()
                )
        return names

    assert asyncio.run(follow()) == ["exec_start", "exec_end"]


def test_embedded_reconnect_after_the_end_gets_nothing_the_log_has_after_it(plane: LocalBackplane) -> None:
    """A reader sends a job's end taken from the records when its log has none 10 s after the job
    closed; its worker's may still come after it (its close retried through a database outage),
    and so may a call's end that outlived the job. A reconnect from the end sent (EventSource makes
    one by itself) was sent those, a second end among them: on Redis it closes at once, as here."""
    user = get_user_model().objects.create_user(username=f"late-{uuid.uuid4().hex[:6]}")
    closed = timezone.now() - timedelta(seconds=events.END_LOST_SECONDS + 5)
    job = running_job(user=user, status="completed", started_at=closed, finished_at=closed, stdout="hi\n")
    plane.events_append(job.call_id, [("exec_start", events.job_start_payload(job)), ("stdout", {"text": "hi\n"})])

    async def read(last_event_id: str | None = None) -> list[events.Event]:
        stream = events.event_stream(job_id=job.pk, last_event_id=last_event_id)
        return [event async for event in stream if event is not None]

    sent = asyncio.run(read())
    assert [e.event for e in sent] == ["exec_start", "stdout", "exec_end"]
    late = [("exec_end", {"status": "completed"}), ("tool_call_end", {"call_id": "ptc_late"})]
    plane.events_append(job.call_id, late)  # the worker's end, late, and a call that outlived the job
    assert asyncio.run(read(sent[-1].id)) == []
    assert [e.event for e in asyncio.run(read())] == ["exec_start", "stdout", "exec_end"]  # the end first sent


def test_embedded_log_whose_end_was_torn_still_ends_its_stream(tmp_path: Path, settings: Any, plane: LocalBackplane) -> None:
    """A worker's ``exec_end`` cut short (a full disk) is a line with no end; the one its reader
    then appends from the records goes on after it, on the same line, which is torn, and skipped.
    That line was taken for the log's end all the same: not behind the reader, and not lost, so
    the reader waited for it for ever, sending heartbeats. A torn end is no end."""
    settings.PTC_EVENTS_HEARTBEAT_SECONDS = 0.2
    user = get_user_model().objects.create_user(username=f"torn-{uuid.uuid4().hex[:6]}")
    closed = timezone.now() - timedelta(seconds=events.END_LOST_SECONDS + 5)
    job = running_job(user=user, status="completed", started_at=closed, finished_at=closed, stdout="hi\n")
    plane.events_append(job.call_id, [("exec_start", events.job_start_payload(job))])
    with open(tmp_path / "events" / f"{job.call_id}.log", "ab") as log:
        log.write(b'exec_end\t{"status":')

    async def read() -> list[events.Event]:
        stream = events.event_stream(job_id=job.pk)
        return [event async for event in stream if event is not None]

    got = asyncio.run(asyncio.wait_for(read(), 10))
    assert [e.event for e in got] == ["exec_start", "exec_end"] and got[-1].data["stdout"] == "hi\n"


def test_embedded_log_that_takes_no_append_still_ends_its_stream(tmp_path: Path, plane: LocalBackplane) -> None:
    """A full disk loses a worker's ``exec_end`` (the append logs a warning, the records are the
    truth), and then the one its reader appends from the records too: the reader looked for it
    again at once, for ever, rebuilding the job's view from the database each time (a core and a
    database connection per reader). An end that can't be appended is sent from the records."""
    user = get_user_model().objects.create_user(username=f"full-{uuid.uuid4().hex[:6]}")
    closed = timezone.now() - timedelta(seconds=events.END_LOST_SECONDS + 5)
    job = running_job(user=user, status="completed", started_at=closed, finished_at=closed, stdout="hi\n")
    plane.events_append(job.call_id, [("exec_start", events.job_start_payload(job)), ("stdout", {"text": "hi\n"})])
    log = tmp_path / "events" / f"{job.call_id}.log"
    # Immutable: read as before, appended to by no one (root included), as a full disk's file is.
    if subprocess.run(["chattr", "+i", str(log)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not permitted here")
    try:

        async def read(last_event_id: str | None = None) -> list[events.Event]:
            stream = events.event_stream(job_id=job.pk, last_event_id=last_event_id)
            return [event async for event in stream if event is not None]

        got = asyncio.run(asyncio.wait_for(read(), 10))
        assert [e.event for e in got] == ["exec_start", "stdout", "exec_end"]
        assert got[-1].data["stdout"] == "hi\n"
    finally:
        subprocess.run(["chattr", "-i", str(log)], check=True)


def test_embedded_cli_shows_the_end_of_an_output_past_the_limit(embedded: tuple[Stack, str], tmp_path: Path) -> None:
    """ptc_exec prints a job's output as its live chunks bring it; they stop at the job's limit
    (PTC_MAX_OUTPUT_BYTES), saying that exec_end has the tail, which it never printed: its last
    lines (a result, the end of a traceback) were nowhere. On the embedded default it printed the
    stored output, head and tail, until its log brought the live chunks."""
    stack, _ = embedded
    script = tmp_path / "job.py"
    script.write_text("for i in range(1100):\n    print(str(i).rjust(6) + 'x' * 994)\nprint('THE END')\n")
    out = subprocess.run(
        [sys.executable, "manage.py", "ptc_exec", str(script), "--user", "embedded", "--toolsets", "demo"],
        cwd=ROOT,
        env=stack.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert "[output truncated here; exec_end has its tail]" in lines
    assert lines[-3] == "THE END" and lines.count("THE END") == 1, lines[-5:]


def test_embedded_log_that_cannot_be_read_is_told_by_the_records(tmp_path: Path, plane: LocalBackplane) -> None:
    """A log the web can't read (the workers' OS user's, mode 0600; here, a folder in its place)
    raised out of every stream of the job, cut with a traceback (EventSource then reconnected every
    second), and out of an MCP call that followed it. Read as no log: the records tell the job."""
    user = get_user_model().objects.create_user(username=f"unread-{uuid.uuid4().hex[:6]}")
    closed = timezone.now() - timedelta(seconds=events.END_LOST_SECONDS + 5)
    job = running_job(user=user, status="completed", started_at=closed, finished_at=closed, stdout="hi\n")
    (tmp_path / "events" / f"{job.call_id}.log").mkdir(parents=True)

    async def read(last_event_id: str | None = None) -> list[events.Event]:
        stream = events.event_stream(job_id=job.pk, last_event_id=last_event_id)
        return [event async for event in stream if event is not None]

    got = asyncio.run(asyncio.wait_for(read(), 10))
    assert [e.event for e in got] == ["exec_start", "exec_end"] and got[-1].data["stdout"] == "hi\n"
    assert asyncio.run(asyncio.wait_for(read("205-0"), 10))[-1].event == "exec_end"


def test_embedded_log_reads_past_a_torn_line_once(
    tmp_path: Path, settings: Any, caplog: pytest.LogCaptureFixture, plane: LocalBackplane
) -> None:
    """A torn line that a running job's reader reads alone (nothing whole after it yet) is skipped
    once: the reader stayed before it, and read it again (and said so) at every wake-up after."""
    settings.PTC_EVENTS_HEARTBEAT_SECONDS = 0.1
    user = get_user_model().objects.create_user(username=f"torn-{uuid.uuid4().hex[:6]}")
    now = timezone.now()
    job = running_job(user=user, started_at=now, heartbeat_at=now)
    plane.events_append(job.call_id, [("exec_start", {"id": str(job.pk)})])

    async def follow() -> list[str]:
        got = []
        async for event in events.event_stream(job_id=job.pk):
            got.append(event.event if event is not None else "heartbeat")
            if got == ["exec_start"]:  # then a torn line, and a line end: whole as a line, not as an event
                with open(tmp_path / "events" / f"{job.call_id}.log", "ab") as log:
                    log.write(b'stdout\t{"text":\n')
                plane.publish(job_channel(job.call_id), Changed())
            if len(got) == 6:
                return got
        return got

    assert asyncio.run(follow()) == ["exec_start"] + ["heartbeat"] * 5
    assert sum("skipped a torn line" in r.getMessage() for r in caplog.records) == 1


def test_embedded_a_calls_end_is_logged_before_its_result_can_end_the_job(
    tmp_path: Path, settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A tools worker pushes a call's result to its code and logs the call's end; code that ends
    # the moment it has the result gets its job's exec_end logged at once. The end of the call
    # must be in the log before it: every stream ends at exec_end.
    settings.DATA_DIR = tmp_path
    plane = LocalBackplane()
    job = f"exec_{uuid.uuid4().hex}"
    push = plane._publish

    def code_that_ends_at_once(channel: str, data: dict[str, Any]) -> None:
        push(channel, data)
        if channel == "result":
            plane.events_append(job, [("exec_end", {"status": "completed"})])

    monkeypatch.setattr(plane, "_publish", code_that_ends_at_once)
    result = Result(call_id="ptc_1", ok=True, result={"slept_ms": 1})
    plane.publish_then_append([("result", result)], [(job, [("tool_call_end", {"call_id": "ptc_1"})])])
    assert [name for _, name, _ in plane.events_read(job)] == ["tool_call_end", "exec_end"]


def test_embedded_under_load_every_stream_tells_every_call(embedded: tuple[Stack, str]) -> None:
    # 30 jobs at once, 16 parallel calls each, half of them waited for, each followed by an SSE
    # reader: SQLite, the filesystem broker and the event log files under load.
    stack, _ = embedded
    key = subprocess.run(
        [sys.executable, "manage.py", "create_api_key", "embedded-load", "--create-user", "--credits", "10000"],
        cwd=ROOT,
        env=stack.env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.splitlines()[-1]
    code = (
        "import asyncio\nfrom ptc_tools.demo import Demo\nprint('before')\n"
        "done = await asyncio.gather(*(Demo.sleep.aio(ms=200) for _ in range(16)))\nprint('after')\nlen(done)"
    )

    def submit_and_follow(index: int) -> tuple[int, str, dict[str, Any], list[dict[str, Any]]]:
        with httpx.Client(base_url=stack.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=120) as http:
            response = http.post("/api/v1/exec", json={"code": code, "toolsets": ["demo"], "wait": 60 if index % 2 else 0})
            if response.status_code != 201:
                return response.status_code, response.text, {}, []
            job_id = response.json()["id"]
            streamed, _ = read_events(_Client(stack.base_url, key), job_id, timeout=120)  # type: ignore[arg-type]
            return 201, "", http.get(f"/api/v1/exec/{job_id}").json(), streamed

    with ThreadPoolExecutor(30) as pool:
        done = list(pool.map(submit_and_follow, range(30)))
    for status, text, job, streamed in done:
        assert status == 201, text
        assert job["status"] == "completed", job["error"]
        assert job["return_value"] == 16
        names = [event["event"] for event in streamed]
        assert names[0] == "exec_start" and names[-1] == "exec_end"
        assert len({event["id"] for event in streamed}) == len(streamed)
        for call in job["tool_calls"]:
            told = [event["event"] for event in streamed if event["data"].get("call_id") == call["call_id"]]
            assert told == ["tool_call_start", "tool_call_end"], (job["id"], call["call_id"], names)
        assert "".join(event["data"]["text"] for event in streamed if event["event"] == "stdout") == "before\nafter\n"
