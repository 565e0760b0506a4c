"""GET /api/v1/exec/{id}/events: order, completeness, resume, late connect, rebuilt history, privacy."""

import asyncio
import json
import re
import signal
import subprocess
import sys
import time
from datetime import timedelta
from typing import Any

import httpx
import pytest
import redis
from django.contrib.auth.models import User

from execution.backplane import RedisBackplane
from execution.events import event_stream
from execution.models import ExecJob, ToolCall
from ptcproject.accounts.services import api_key_create
from tests.conftest import REDIS_URL, Api
from tests.stack import ROOT

JOB = """
import sys
from concurrent.futures import ThreadPoolExecutor
from ptc_tools import ToolError
from ptc_tools.demo import Demo
print("before")
with ThreadPoolExecutor(4) as pool:
    list(pool.map(lambda i: Demo.sleep(ms=200), range(4)))
try:
    Demo.fail(message="expected")
except ToolError:
    print("caught", file=sys.stderr)
print("after")
"""


def read_events(
    api: Api, job_id: str, last_event_id: str | None = None, timeout: float = 30
) -> tuple[list[dict[str, Any]], list[str]]:
    """Read the stream to its end; return the events and the comment lines (heartbeats)."""
    headers = {"Last-Event-ID": last_event_id} if last_event_id else {}
    events: list[dict[str, Any]] = []
    comments: list[str] = []
    current: dict[str, Any] = {}
    with api.http.stream("GET", f"/api/v1/exec/{job_id}/events", headers=headers, timeout=timeout) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith(":"):
                comments.append(line)
            elif line.startswith("id: "):
                current["id"] = line[4:]
            elif line.startswith("event: "):
                current["event"] = line[7:]
            elif line.startswith("data: "):
                current["data"] = json.loads(line[6:])
            elif not line and current:
                events.append(current)
                current = {}
    return events, comments


def read_to_close(api: Api, job_id: str, last_event_id: str, within: float) -> tuple[list[str], float]:
    """Read the stream from ``last_event_id`` until it closes, failing if it is still open after
    ``within`` seconds; return its lines and the seconds it took."""
    started, lines = time.monotonic(), []
    headers = {"Last-Event-ID": last_event_id}
    with api.http.stream("GET", f"/api/v1/exec/{job_id}/events", headers=headers, timeout=within + 5) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            lines.append(line)
            assert time.monotonic() - started < within, f"still open, sending {lines[-3:]}"
    return lines, time.monotonic() - started


def _order(event_id: str) -> tuple[int, int]:
    ms, seq = event_id.split("-")
    return int(ms), int(seq)


def _check_sequence(events: list[dict[str, Any]], job: dict[str, Any], with_output: bool) -> None:
    names = [e["event"] for e in events]
    assert names[0] == "exec_start" and names[-1] == "exec_end"
    assert [_order(e["id"]) for e in events] == sorted({_order(e["id"]) for e in events})  # increasing, unique
    calls = [e for e in events if e["event"].startswith("tool_call")]
    assert all(e["data"]["ptc"] is True for e in calls)
    for call in job["tool_calls"]:
        mine = [e["event"] for e in calls if e["data"]["call_id"] == call["call_id"]]
        assert mine == ["tool_call_start", "tool_call_end" if call["status"] == "completed" else "tool_call_error"]
    end = events[-1]["data"]
    assert "code" not in end
    assert end["status"] == "completed"
    assert end["stdout"] == "before\nafter\n"
    if with_output:
        assert "".join(e["data"]["text"] for e in events if e["event"] == "stdout") == "before\nafter\n"
        assert "".join(e["data"]["text"] for e in events if e["event"] == "stderr") == "caught\n"
        assert names.index("stdout") < names.index("tool_call_start")  # "before" came first


def test_events_arrive_in_order_and_complete(api: Api) -> None:
    job = api.run(JOB, toolsets=["demo"], wait=0)
    events, _ = read_events(api, job["id"])
    final = api.get(f"/api/v1/exec/{job['id']}").json()
    assert len(final["tool_calls"]) == 5
    _check_sequence(events, final, with_output=True)


def test_resume_with_last_event_id(api: Api) -> None:
    job = api.run(JOB, toolsets=["demo"])
    everything, _ = read_events(api, job["id"])
    resumed, _ = read_events(api, job["id"], last_event_id=everything[3]["id"])
    assert resumed == everything[4:]


def test_a_late_client_gets_the_whole_history_then_the_end(api: Api) -> None:
    job = api.run(JOB, toolsets=["demo"])
    assert job["status"] == "completed"
    events, _ = read_events(api, job["id"])
    _check_sequence(events, job, with_output=True)


def test_history_is_rebuilt_from_the_records_after_the_stream_expired(api: Api) -> None:
    job = api.run(JOB, toolsets=["demo"])
    live, _ = read_events(api, job["id"])
    redis.Redis.from_url(REDIS_URL).delete(RedisBackplane.stream_key(job["call_id"]))  # as if it had expired
    rebuilt, _ = read_events(api, job["id"])
    _check_sequence(rebuilt, job, with_output=False)
    # The same events (calls that end within a millisecond of each other may swap places).
    without_output = [(e["event"], e["data"].get("call_id")) for e in live if e["event"] not in ("stdout", "stderr")]
    assert sorted(map(str, [(e["event"], e["data"].get("call_id")) for e in rebuilt])) == sorted(map(str, without_output))
    resumed, _ = read_events(api, job["id"], last_event_id=rebuilt[2]["id"])
    assert resumed == rebuilt[3:]


def test_a_quiet_stream_sends_heartbeats(api: Api) -> None:
    job = api.run("import time\ntime.sleep(2.5)", toolsets=["demo"], wait=0)
    _, comments = read_events(api, job["id"])
    assert ": heartbeat" in comments


def test_a_stream_stays_open_while_its_job_is_quiet_longer_than_a_redis_read_timeout(api: Api, settings: Any) -> None:
    # redis-py gives up on a read after 5 s unless told otherwise: with heartbeats further apart
    # than that (15 s by default), every quiet stream was cut as if Redis had gone. Followed here
    # in this process, with heartbeats 6 s apart, through a job quiet for 7 s.
    settings.PTC_EVENTS_HEARTBEAT_SECONDS = 6
    job = api.run("print('start', flush=True)\nimport time\ntime.sleep(7)", toolsets=["demo"], wait=0)

    async def follow() -> list[str | None]:
        return [None if item is None else item.event async for item in event_stream(job_id=job["id"])]

    names = asyncio.run(follow())
    assert names[0] == "exec_start" and "stdout" in names and None in names  # a heartbeat, not a cut
    assert names[-1] == "exec_end"


def test_a_reconnect_after_the_end_closes_at_once(api: Api) -> None:
    # A browser's EventSource reconnects by itself once a stream closes, with the last id it had.
    job = api.run("print(1)", toolsets=["demo"])
    events, _ = read_events(api, job["id"])
    assert events[-1]["event"] == "exec_end"
    lines, took = read_to_close(api, job["id"], events[-1]["id"], within=10)
    assert [line for line in lines if line.startswith(("id:", "event:", "data:"))] == []
    assert took < 5


def test_a_reconnect_after_the_end_closes_when_a_call_outlived_the_job(api: Api) -> None:
    # A call still running as its job ends appends its tool_call_end after exec_end: the log no
    # longer ends with exec_end, and a reconnect from it must still close, not wait out the log.
    code = (
        "import threading, time\nfrom ptc_tools.demo import Demo\n"
        "threading.Thread(target=lambda: Demo.sleep(ms=1500), daemon=True).start()\ntime.sleep(0.5)"
    )
    job = api.run(code, toolsets=["demo"])
    events, _ = read_events(api, job["id"])
    assert events[-1]["event"] == "exec_end"
    deadline = time.monotonic() + 15
    while api.get(f"/api/v1/exec/{job['id']}").json()["tool_calls"][0]["status"] == "executing":
        assert time.monotonic() < deadline, "the call did not end"
        time.sleep(0.2)
    lines, _ = read_to_close(api, job["id"], events[-1]["id"], within=8)
    assert "event: exec_end" not in lines


def test_a_last_event_id_ahead_of_every_event_still_closes_at_the_end(api: Api) -> None:
    # Well formed, so not a 400, but ahead of every id the job's log will hold: its exec_end lands
    # behind the cursor, and the stream must still close once the job has ended.
    job = api.run("import time\ntime.sleep(1)\n1", toolsets=["demo"], wait=0)
    lines, _ = read_to_close(api, job["id"], f"{int(time.time() * 1000) + 10**9}-0", within=12)
    assert api.get(f"/api/v1/exec/{job['id']}").json()["status"] == "completed"
    assert [line for line in lines if line.startswith(("id:", "event:", "data:"))] == []


def test_another_users_stream_is_404_and_no_key_is_401(make_api) -> None:  # type: ignore[no-untyped-def]
    alice, bob = make_api(), make_api()
    job = alice.run("1", toolsets=["demo"])
    response = bob.get(f"/api/v1/exec/{job['id']}/events")
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "not_found"
    anonymous = httpx.get(f"{alice.http.base_url}/api/v1/exec/{job['id']}/events")
    assert (anonymous.status_code, anonymous.json()["error"]["code"]) == (401, "not_authenticated")
    # As DRF's views answer: an unknown key, a job-scoped key, a method other than GET.
    unknown = httpx.get(anonymous.url, headers={"Authorization": "Bearer ptc_nope_nope"})
    assert (unknown.status_code, unknown.json()["error"]["code"]) == (401, "authentication_failed")
    _, key = api_key_create(user=User.objects.get(username=alice.username), exec_job=ExecJob.objects.get(pk=job["id"]))
    scoped = httpx.get(anonymous.url, headers={"Authorization": f"Bearer {key}"})
    assert (scoped.status_code, scoped.json()["error"]["code"]) == (403, "permission_denied")
    posted = alice.post(f"/api/v1/exec/{job['id']}/events")
    assert (posted.status_code, posted.json()["error"]["code"]) == (405, "method_not_allowed")


def test_a_cancelled_queued_job_still_ends_its_stream(api: Api) -> None:
    job = api.run("1", toolsets=["demo"], wait=0)
    api.post(f"/api/v1/exec/{job['id']}/cancel")
    started = time.monotonic()
    events, _ = read_events(api, job["id"])
    assert events[-1]["event"] == "exec_end"
    assert events[-1]["data"]["status"] in ("cancelled", "completed")
    assert time.monotonic() - started < 5


def _cli(stack_env: dict[str, str], username: str, code: str, tmp_path) -> subprocess.CompletedProcess:  # type: ignore[no-untyped-def]
    script = tmp_path / "job.py"
    script.write_text(code)
    return subprocess.run(
        [sys.executable, "manage.py", "ptc_exec", str(script), "--user", username, "--toolsets", "demo"],
        cwd=ROOT,
        env=stack_env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_cli_follows_a_job_and_exits_by_its_outcome(api: Api, stack_env: dict[str, str], tmp_path) -> None:  # type: ignore[no-untyped-def]
    ok = _cli(stack_env, api.username, JOB, tmp_path)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    lines = ok.stdout.splitlines()
    call_id, job_id = re.fullmatch(r"job (exec_[0-9a-f]+) submitted, id ([0-9a-f-]{36})", lines[0]).groups()  # type: ignore[union-attr]
    assert api.get(f"/api/v1/exec/{job_id}").json()["call_id"] == call_id  # the id the API takes
    assert "INFO" not in ok.stderr  # the services' log lines are not mixed into its own (-v 2 shows them)
    assert "before" in lines and "after" in lines
    assert sum(line.startswith("✓ demo.sleep(ms=200)") for line in lines) == 4
    assert any(line.startswith("✗ demo.fail(message='expected')") and line.endswith("expected") for line in lines)
    assert any(line.startswith("status completed   calls 5 (1 failed)   credits 4") for line in lines)
    assert lines[-1].startswith("timeline: http") and lines[-1].endswith("/change/")
    failed = _cli(stack_env, api.username, "1/0", tmp_path)
    assert failed.returncode == 1
    assert "status failed" in failed.stdout
    assert "ZeroDivisionError: division by zero" in failed.stdout


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM])
def test_the_cli_stopped_cancels_its_job(api: Api, stack_env: dict[str, str], tmp_path, stop: int) -> None:  # type: ignore[no-untyped-def]
    """Ctrl-C (or a SIGTERM) on ptc_exec cancels the job it submitted, as ptc_mcp stopped does: the
    job ran on to its timeout with nobody following it (a client tool it answered waited its own
    timeout), holding its place among its user's jobs at once, and the command ended in a traceback."""
    script = tmp_path / "job.py"
    script.write_text("import time\nprint('started', flush=True)\ntime.sleep(60)\n")
    args = [sys.executable, "manage.py", "ptc_exec", str(script), "--user", api.username, "--timeout", "90"]
    env = {**stack_env, "PTC_LOG_LEVEL": "WARNING"}
    cli = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        user = User.objects.get(username=api.username)
        while not ExecJob.objects.filter(user=user, status="running").exists():
            assert time.monotonic() < deadline and cli.poll() is None, "the job did not start"
            time.sleep(0.2)
        time.sleep(1)  # its code runs, and the command follows it
        cli.send_signal(stop)
        out, err = cli.communicate(timeout=20)
    finally:
        cli.kill()
    job = ExecJob.objects.get(user=user)
    assert job.status == "cancelled", (job.status, out, err)
    assert cli.returncode != 0
    assert "Traceback" not in err, err
    assert "status cancelled" in out


def test_a_process_forgets_the_users_who_follow_nothing() -> None:
    # Each user who ever opened an event stream or an MCP job call kept an entry (an empty set of
    # places) in the process's table for its whole life: one per user, however long ago.
    from execution import events

    for user_id in range(10_000_000, 10_002_000):
        place = events.follow_admit(user_id=user_id)
        del place  # the stream ended: its place is given back
    assert len(events._FOLLOWS) <= 2 * events.FOLLOW_SWEEP_FROM + 1


BIG_CALLS = """
from ptc_tools.demo import Demo
big = "x" * 200_000
for i in range(5):
    Demo.echo(value=f"{i}{big}")
print("done")
"""


def test_a_jobs_large_calls_are_streamed_whole_but_logged_small(api: Api) -> None:
    """Every call's events and the job's end repeat its input and output, and the log is kept in
    Redis an hour past the end: a job passing PTC_MAX_JOB_TOOL_BYTES wrote about three times that
    there, so one user's jobs could fill the broker's server for everyone (here 5 calls of 200 KB
    each way logged 5.0 MB). The log keeps such events without their large fields; the stream
    fills them in from the records, so readers see every byte as before."""
    job = api.run(BIG_CALLS, toolsets=["demo"])
    assert job["status"] == "completed", job["error"]
    events, _ = read_events(api, job["id"])
    names = [e["event"] for e in events]
    # (A call's end is logged after its result reached the code: the next call's start may come first.)
    assert names[0] == "exec_start" and names[-1] == "exec_end", names
    assert sorted(names[1:-1]) == sorted(["stdout", *["tool_call_start", "tool_call_end"] * 5]), names
    ends = [e["data"] for e in events if e["event"] == "tool_call_end"]
    starts = [e["data"] for e in events if e["event"] == "tool_call_start"]
    assert sorted(e["output"][0] for e in ends) == list("01234") and all(len(e["output"]) == 200_001 for e in ends)
    assert all(len(e["input"]["value"]) == 200_001 and e["output"] is None for e in starts)
    [end] = [e["data"] for e in events if e["event"] == "exec_end"]
    assert end == {name: value for name, value in job.items() if name != "code"}
    logged = sum(len(f[b"data"]) for _, f in redis.Redis.from_url(REDIS_URL).xrange(RedisBackplane.stream_key(job["call_id"])))
    assert logged < 64 * 1024, logged


def test_a_pending_calls_large_input_is_filled_in_from_its_record(api: Api) -> None:
    """A call that waits (for its client or an approval) is announced with its input twice, at the
    top and in ``call``: both are left out of the log, and filled in from the record."""
    from execution.backplane import _slim
    from execution.events import event_filled, tool_call_pending_payload
    from tests.factories import demo_call, running_job

    user = User.objects.get(username=api.username)
    job = running_job(user=user)
    call = demo_call(user=user, job=job, tool="echo", input={"value": "y" * 5000}, status="awaiting_approval")
    payload = tool_call_pending_payload(call)
    slim = json.loads(json.dumps(_slim(payload)))
    assert sorted(slim["_omitted"]) == ["call.input", "input"] and "input" not in slim["call"]
    assert event_filled(job.pk, "tool_call_pending", slim) == json.loads(json.dumps(payload))


def _end_lost_from_log(job: dict[str, Any]) -> tuple[redis.Redis, str]:
    """Take the finished ``job``'s end out of its log, and its expiry, as an append lost to a Redis
    away at that moment leaves it, and date its close a minute back; return the log's client and key."""
    client = redis.Redis.from_url(REDIS_URL)
    key = RedisBackplane.stream_key(job["call_id"])
    [end_id] = [raw for raw, fields in client.xrange(key) if fields[b"event"] == b"exec_end"]
    client.xdel(key, end_id)
    client.persist(key)
    ExecJob.objects.filter(pk=job["id"]).update(closed_at=ExecJob.objects.get(pk=job["id"]).closed_at - timedelta(minutes=1))
    return client, key


def test_a_job_whose_end_was_never_logged_still_ends_its_stream(api: Api) -> None:
    """A job's end is recorded, then appended to its log; an append lost to a Redis that went away
    at that moment (nothing raises: the records are the truth) left a log with no ``exec_end``,
    and with no expiry, which is set with it. A reader of that log waited for the end for ever,
    sending heartbeats. Once the job has been closed a while, the end is taken from the records."""
    job = api.run("print(1)", toolsets=["demo"])
    client, key = _end_lost_from_log(job)
    lines, _ = read_to_close(api, job["id"], "0-0", within=10)
    events = [line[7:] for line in lines if line.startswith("event: ")]
    assert events[0] == "exec_start" and events[-1] == "exec_end", events
    end = json.loads(lines[lines.index("event: exec_end") + 1][6:])
    assert end == {name: value for name, value in job.items() if name != "code"}
    assert 0 < client.ttl(key) <= 3600  # its expiry, lost with the end, is set again
    # A reconnect from that end (EventSource makes one by itself) closes, with nothing more.
    again, _ = read_to_close(api, job["id"], lines[lines.index("event: exec_end") - 1][4:], within=10)
    assert [line for line in again if line.startswith(("id:", "event:", "data:"))] == []


def test_a_job_log_expires_even_if_its_end_never_reaches_it(api: Api) -> None:
    """A log took its expiry with its end: one whose end was never appended (its worker killed as
    the end was stored, Redis away at that moment) and that no reader came for stayed in Redis for
    good. It expires from its start, well after the job can have ended; its end shortens that to
    the retention."""
    from django.conf import settings

    job = api.run("print('up', flush=True)\nimport time\ntime.sleep(30)", toolsets=["demo"], wait=0, timeout=40)
    assert api.until_printed(job["id"]) == "up\n"
    client = redis.Redis.from_url(REDIS_URL)
    key = RedisBackplane.stream_key(job["call_id"])
    running = client.ttl(key)
    # Its clock (40 s), its waits on the client (the policy's 600 s), a ceiling, the stack's lease
    # (4 s), the retries of its end, then the retention: a few seconds less by now.
    longest = 40 + 600 + settings.PTC_TIMEOUT_CEILING + 4 + settings.PTC_DB_RETRY_SECONDS
    assert longest + 3600 - 30 < running <= longest + 3600, running
    assert api.post(f"/api/v1/exec/{job['id']}/cancel").status_code == 200
    assert 3600 - 30 < client.ttl(key) <= 3600  # its end appended: the retention


def test_a_reconnect_to_a_long_log_of_an_ended_job_looks_for_its_end_near_the_cursor(api: Api) -> None:
    """A reconnect after the job's end asks whether the client had the end already: the log was
    paged back from the client's cursor to its very start (100 entries a round trip) when the end
    lay ahead, 500 round trips for a full log. Past the end only the ends of calls that outlived
    the job are logged (at most the parallel cap's), so that is as far back as an end can be."""
    job = api.run("print(1)", toolsets=["demo"])
    client = redis.Redis.from_url(REDIS_URL)
    key = RedisBackplane.stream_key(job["call_id"])
    entries = client.xrange(key)
    [end] = [fields for _, fields in entries if fields[b"event"] == b"exec_end"]
    client.delete(key)  # written again, long: a job that printed 12,000 chunks
    pipe = client.pipeline(transaction=False)
    for n in range(12_000):
        pipe.xadd(key, {"event": "stdout", "data": json.dumps({"text": f"{n}\n"})})
    pipe.xadd(key, end)
    pipe.execute()
    middle = client.xrange(key, count=6_001)[-1][0].decode()

    def xrevranges() -> int:
        return int(client.info("commandstats").get("cmdstat_xrevrange", {}).get("calls", 0))

    before = xrevranges()
    events, _ = read_events(api, job["id"], last_event_id=middle)
    assert len(events) == 6_000 and events[-1]["event"] == "exec_end"
    assert xrevranges() - before <= 22  # END_WITHIN (2,148 entries) in pages of 100, where it took 61


def test_a_live_reader_gets_a_large_input_of_a_call_no_tools_worker_has_taken_yet(api: Api, staff: Api) -> None:
    """A call for a tools worker is announced (``tool_call_start``) before it is recorded: the
    worker that claims it writes its record. Its start, logged without its large input, was filled
    in from a record that did not exist yet: a live reader got it with no ``input`` at all. Here the
    call waits on tools.slow, which no worker of the test stack serves, so it is never recorded."""
    from tests.tools.conftest import unique_key
    from tools.sdk import class_name

    key = unique_key("queued")
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    tool = {"name": "forecast", "input_schema": schema, "http": {"method": "GET", "path": "/forecast/{city}", "query": []}}
    body = {"key": key, "name": "Queued", "kind": "http", "config": {"base_url": "http://127.0.0.1:9"}, "tools": [tool]}
    assert staff.post("/api/v1/toolsets", json={**body, "queue": "tools.slow"}).status_code == 201
    city = "y" * 20_000
    code = f"from ptc_tools.{key} import {class_name(key)} as S\nS.forecast(city={city!r})"
    job = api.run(code, toolsets=[key], wait=0)
    try:
        start: dict[str, Any] = {}
        with api.http.stream("GET", f"/api/v1/exec/{job['id']}/events", timeout=20) as response:
            event = ""
            for line in response.iter_lines():
                if line.startswith("event: "):
                    event = line[7:]
                elif line.startswith("data: ") and event == "tool_call_start":
                    start = json.loads(line[6:])
                    break
        assert start.get("input") == {"city": city}, sorted(start)
    finally:
        assert api.post(f"/api/v1/exec/{job['id']}/cancel").status_code == 200


def test_an_end_sent_from_the_records_is_the_only_one_even_if_the_logged_one_comes_late(api: Api) -> None:
    """A job's end is sent from the records when it is not in the log 10 s after the job closed.
    The worker's may still come after that (its close retried through a database outage, or its
    store did: ``closed_at`` is when it began), and a client reconnecting from the end it was sent
    (EventSource does so by itself) got the job's end a second time."""
    from execution.events import events_publish, exec_job_with_calls, job_end_payload, job_view

    job = api.run("print(1)", toolsets=["demo"])
    _end_lost_from_log(job)
    lines, _ = read_to_close(api, job["id"], "0-0", within=10)
    sent = lines[lines.index("event: exec_end") - 1][4:]
    # The worker's end, late.
    events_publish(
        job_call_id=job["call_id"], events=[("exec_end", job_end_payload(job_view(exec_job_with_calls(job_id=job["id"]))))]
    )
    again, _ = read_to_close(api, job["id"], sent, within=10)
    assert [line for line in again if line.startswith(("id:", "event:", "data:"))] == []
    # And one who reads the whole log now reads one end, the one sent first.
    events, _ = read_events(api, job["id"])
    assert [e["event"] for e in events].count("exec_end") == 1 and events[-1]["id"] == sent, events


def test_a_logged_event_whose_record_was_purged_since_reads_as_the_record_now_says(api: Api) -> None:
    """Retention empties a job's calls, then drops its log; a drop that fails leaves the log (it
    expires on its own; a managed container's never does). A call's end logged without part of its
    output (``output.big``) was filled in from a record whose output is now null: the stream broke
    there, on every reconnect. It reads as the record says now, as the job's view does."""
    from execution.services.retention import _tool_calls_empty

    job = api.run('from ptc_tools.demo import Demo\nDemo.echo(value={"big": "x" * 20_000, "n": 1})', toolsets=["demo"])
    assert job["status"] == "completed", job["error"]
    ExecJob.objects.filter(pk=job["id"]).update(stdout="", return_value=None)
    _tool_calls_empty(ToolCall.objects.filter(exec_job_id=job["id"]))  # as a purge whose drop of the log failed
    events, _ = read_events(api, job["id"])
    assert [e["event"] for e in events][-1] == "exec_end", [e["event"] for e in events]
    [end] = [e["data"] for e in events if e["event"] == "tool_call_end"]
    assert end["output"] is None and end["input"] == {}, end


def test_an_end_from_the_records_waits_for_the_jobs_close(api: Api) -> None:
    """A job's close (its queued calls failed as never run, its waiting ones failed, then its end
    announced) comes after its end is stored, and retries through a database outage, and
    ``closed_at`` is when the store began: 10 s after it, the end was taken from the records
    before the close had run, showing calls open that the close then failed, and it was the end
    every reader got. It is taken once nothing is left for the close to do."""
    import threading

    from execution.services.jobs import _exec_job_close
    from tests.factories import demo_call

    job = api.run("print(1)", toolsets=["demo"])
    _end_lost_from_log(job)
    # A call still queued, as the job's close, not run yet, finds it.
    queued = demo_call(user=User.objects.get(username=api.username), job=ExecJob.objects.get(pk=job["id"]))
    closer = threading.Timer(4, lambda: _exec_job_close(job_id=job["id"]))
    closer.start()
    try:
        events, _ = read_events(api, job["id"])
    finally:
        closer.join()
    end = events[-1]["data"]
    assert events[-1]["event"] == "exec_end" and [c["call_id"] for c in end["tool_calls"]] == [queued.call_id], events
    assert end["tool_calls"][0]["status"] == "failed" and end["tool_calls"][0]["error"]["code"] == "job_ended", end
