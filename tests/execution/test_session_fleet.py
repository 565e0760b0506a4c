"""Sessions across a fleet of two exec workers: every job of a session reaches the worker holding
its sandbox; a worker that is stopped or dies ends its sessions ``lost``, never a hang.

A deployment of its own (its database and queues): these tests stop and kill its exec workers."""

import os
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from tests.conftest import REDIS_PREFIX, TEST_DATABASE_URL, Api, own_deployment
from tests.servers import api_key, database_drop, migrated_database
from tests.stack import BIN, Process, Stack, free_port, sandboxes_of


class Fleet:
    def __init__(self, stack: Stack, second: Process) -> None:
        self.stack, self.second = stack, second

    def worker(self, node: str) -> Process:
        """The exec worker process of Celery node ``node``."""
        return self.second if node.startswith("exec2-") else self.stack.exec_worker

    def sql(self, query: str, *args: Any) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.stack.env["DATABASE_URL"], autocommit=True) as conn:
            return conn.execute(query, args).fetchall()


@pytest.fixture(scope="module")
def fleet(stack_env: dict[str, str]) -> Iterator[Fleet]:
    env = {**stack_env, "PTC_REDIS_PREFIX": f"{REDIS_PREFIX}sessions:", "PTC_EXEC_CONCURRENCY": "3"}
    env["DATABASE_URL"] = migrated_database(TEST_DATABASE_URL, env)
    stack = Stack(env, name="sessions")
    argv = [str(BIN / "celery"), "-A", "ptcproject", "worker", "-Q", "exec", "-n", f"exec2-{os.getpid()}@%h", "-l", "info"]
    second = Process("sessions-exec-worker-2", argv, env, ready=" ready.")
    try:
        stack.start()
        second.start()
        yield Fleet(stack, second)
    finally:
        second.stop()
        stack.stop()
        database_drop(env["DATABASE_URL"])


def _api(fleet: Fleet) -> Api:
    username = f"fleet-{free_port()}"
    return Api(fleet.stack.base_url, api_key(fleet.stack.env, username), username)


def _session(api: Api) -> str:
    response = api.post("/api/v1/sessions", json={"toolsets": ["demo"]})
    assert response.status_code == 201, response.text
    return str(response.json()["id"])


def _node(fleet: Fleet, session_id: str) -> str:
    return str(fleet.sql("SELECT worker FROM execution_execsession WHERE id = %s", session_id)[0][0])


def _until_status(api: Api, session_id: str, seconds: float) -> dict[str, Any]:
    deadline = time.monotonic() + seconds
    while (session := api.get(f"/api/v1/sessions/{session_id}").json())["status"] == "active":
        assert time.monotonic() < deadline, f"the session is still active after {seconds} s"
        time.sleep(0.1)
    return session


def test_every_job_of_a_session_runs_on_its_worker(fleet: Fleet) -> None:
    api = _api(fleet)
    sessions = [_session(api) for _ in range(3)]
    for session_id in sessions:
        assert api.run("n = 0", session=session_id)["status"] == "completed"
    for _ in range(4):
        for session_id in sessions:
            job = api.run("n += 1\nn", session=session_id)
            assert job["status"] == "completed", job["error"]
    for session_id in sessions:
        workers = fleet.sql("SELECT DISTINCT worker FROM execution_execjob WHERE session_id = %s", session_id)
        assert len(workers) == 1, f"the session's jobs ran on {workers}"
        assert api.run("n", session=session_id)["return_value"] == 4  # one sandbox saw all five
        assert _node(fleet, session_id).startswith(("exec-", "exec2-"))
    for session_id in sessions:
        api.http.delete(f"/api/v1/sessions/{session_id}")


def test_the_holder_kills_the_sandbox_of_an_expired_session(fleet: Fleet) -> None:
    api = _api(fleet)
    response = api.post("/api/v1/sessions", json={"toolsets": ["demo"], "idle_timeout": 2})
    session_id = response.json()["id"]
    pids = {process.proc.pid for process in (fleet.stack.exec_worker, fleet.second) if process.proc}
    before = {pid for worker in pids for pid in sandboxes_of(worker)}
    assert api.run("import time\ntime.sleep(0.5)", session=session_id)["status"] == "completed"
    started = {pid for worker in pids for pid in sandboxes_of(worker)} - before
    assert started, "the session's sandbox should be under an exec worker"
    assert _until_status(api, session_id, 20)["status"] == "expired"
    # Within a lease round (1 s here) of its expiry, its worker kills its sandbox.
    deadline = time.monotonic() + 10
    while any(_running(pid) for pid in started):
        assert time.monotonic() < deadline, "the expired session's sandbox is still running"
        time.sleep(0.2)


def test_a_warm_shutdown_ends_its_sessions_lost(fleet: Fleet) -> None:
    api = _api(fleet)
    session_id = _session(api)
    assert api.run("kept = 1", session=session_id)["status"] == "completed"
    worker = fleet.worker(_node(fleet, session_id))
    try:
        worker.stop()  # SIGTERM: Celery's warm shutdown
        ended = api.get(f"/api/v1/sessions/{session_id}").json()
        assert ended["status"] == "lost" and "shut down" in ended["end_reason"]
        late = api.post("/api/v1/exec", json={"code": "kept", "session": session_id})
        assert late.status_code == 410 and late.json()["error"]["code"] == "session_lost"
    finally:
        worker.start()


def test_a_killed_worker_ends_its_sessions_lost_and_their_queued_job_fails(fleet: Fleet) -> None:
    api = _api(fleet)
    session_id = _session(api)
    assert api.run("kept = 1\nprint('ready')", session=session_id)["stdout"] == "ready\n"
    worker = fleet.worker(_node(fleet, session_id))
    assert worker.proc is not None
    sandboxes = sandboxes_of(worker.proc.pid)
    assert sandboxes, "the session's sandbox should be under its worker"
    try:
        worker.kill()  # SIGKILL: no goodbye
        time.sleep(0.5)
        assert [pid for pid in sandboxes if os.path.exists(f"/proc/{pid}") and _running(pid)] == []
        # Accepted (the database does not know yet) and sent to the dead worker's queue: it must not hang.
        queued = api.run("kept", session=session_id, wait=0)
        ended = _until_status(api, session_id, 20)  # the other worker's reaper: lease 4 s, every 1 s
        assert ended["status"] == "lost"
        deadline = time.monotonic() + 10
        while (job := api.get(f"/api/v1/exec/{queued['id']}").json())["status"] == "queued":
            assert time.monotonic() < deadline, "the queued job of a lost session should fail"
            time.sleep(0.1)
        assert job["status"] == "failed" and job["error"]["type"] == "SessionEnded"
        late = api.post("/api/v1/exec", json={"code": "kept", "session": session_id})
        assert late.status_code == 410 and late.json()["error"]["code"] == "session_lost"
    finally:
        worker.start()
    # The restarted worker (same node name) finds the old message: the job stays failed, once.
    time.sleep(1)
    assert api.get(f"/api/v1/exec/{queued['id']}").json()["status"] == "failed"
    assert api.run("'fresh'", toolsets=["demo"])["return_value"] == "fresh"


def _running(pid: str) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_worker_keeps_at_most_its_sessions_ending_the_one_idle_longest(stack_env: dict[str, str]) -> None:
    """Each session keeps a sandbox on its worker, up to its memory limit, for as long as its idle
    timeout: any number of users' sessions piled up on one worker, whose host they could exhaust.
    Past PTC_SESSIONS_PER_WORKER (2 here) a new session's first job ends the one idle longest,
    ``expired``, saying why, and kills its sandbox; the others keep their state."""
    with own_deployment(stack_env, "session-cap", PTC_SESSIONS_PER_WORKER="2") as stack:
        username = f"cap-{free_port()}"
        api = Api(stack.base_url, api_key(stack.env, username), username)
        worker = stack.exec_worker.proc.pid if stack.exec_worker.proc else 0
        sessions, sandboxes = [], []
        for value in (1, 2, 3):
            before = set(sandboxes_of(worker))
            sessions.append(_session(api))
            job = api.run(f"x = {value}", session=sessions[-1])
            assert job["status"] == "completed", job["error"]
            sandboxes.append(set(sandboxes_of(worker)) - before)
        first = api.get(f"/api/v1/sessions/{sessions[0]}").json()
        assert first["status"] == "expired" and "PTC_SESSIONS_PER_WORKER" in first["end_reason"], first
        assert not any(_running(pid) for pid in sandboxes[0])
        again = api.post("/api/v1/exec", json={"code": "print(x)", "session": sessions[0]})
        assert again.status_code == 410 and again.json()["error"]["code"] == "session_expired", again.text
        for session, value in zip(sessions[1:], (2, 3), strict=True):
            job = api.run("print(x)", session=session)
            assert (job["status"], job["stdout"]) == ("completed", f"{value}\n"), job["error"]
        # With both running a job, there is no room: a new session's first job fails, saying why.
        # (Long enough that neither is idle yet when the new one comes, on a loaded machine too.)
        running = [api.run("import time\ntime.sleep(10)", session=session, wait=0) for session in sessions[1:]]
        for job in running:
            deadline = time.monotonic() + 10
            while api.get(f"/api/v1/exec/{job['id']}").json()["status"] != "running":
                assert time.monotonic() < deadline
                time.sleep(0.05)
        full = _session(api)
        job = api.run("1", session=full)
        assert job["status"] == "failed" and job["error"]["type"] == "SandboxCrashed", job["error"]
        assert "PTC_SESSIONS_PER_WORKER" in job["error"]["message"], job["error"]
        assert api.get(f"/api/v1/sessions/{full}").json()["status"] == "lost"
        for job in running:  # and the two running go on
            deadline = time.monotonic() + 30
            while (final := api.get(f"/api/v1/exec/{job['id']}").json())["status"] == "running":
                assert time.monotonic() < deadline
                time.sleep(0.1)
            assert final["status"] == "completed", final["error"]


def test_sessions_started_at_once_on_a_worker_are_held_to_its_cap_too(stack_env: dict[str, str]) -> None:
    """The cap was checked before a new session's sandbox started, and the sandbox counted once it
    had: first jobs of new sessions taken at once by the worker's threads each found room, and all
    stayed (here 4 with PTC_SESSIONS_PER_WORKER=2), so a burst kept the worker past its cap for as
    long as they lived. With both places taken by sessions running a job, the others fail."""
    from concurrent.futures import ThreadPoolExecutor

    with own_deployment(stack_env, "session-burst", PTC_SESSIONS_PER_WORKER="2", PTC_EXEC_CONCURRENCY="4") as stack:
        username = f"burst-{free_port()}"
        api = Api(stack.base_url, api_key(stack.env, username), username)
        sessions = [_session(api) for _ in range(4)]
        with ThreadPoolExecutor(4) as pool:
            jobs = list(pool.map(lambda s: api.run("import time\ntime.sleep(1)", session=s, wait=30), sessions))
        assert all(job["status"] in ("completed", "failed") for job in jobs), [j["status"] for j in jobs]
        active = [s for s in sessions if api.get(f"/api/v1/sessions/{s}").json()["status"] == "active"]
        assert len(active) <= 2, [(j["status"], (j["error"] or {}).get("type")) for j in jobs]
        failed = [job["error"] for job in jobs if job["status"] == "failed"]
        assert all("PTC_SESSIONS_PER_WORKER" in error["message"] for error in failed), failed
        # Room is given back as sessions end: a new one starts again.
        for session in active:
            assert api.http.delete(f"/api/v1/sessions/{session}").status_code in (200, 204)
        again = _session(api)
        assert api.run("print(1)", session=again)["status"] == "completed"


def test_a_user_making_sessions_on_a_full_worker_ends_their_own_first(stack_env: dict[str, str]) -> None:
    """The session idle the longest was ended for a newcomer, whoever's it was: a user could delete
    and make sessions (4 at a time) and so end every other user's idle session on a worker at will.
    The one ended is now of the user holding the most there (the newcomer's counted), idle longest."""
    with own_deployment(stack_env, "session-fair", PTC_SESSIONS_PER_WORKER="3") as stack:
        users = [f"fair-{free_port()}-{n}" for n in (1, 2)]
        other, maker = (Api(stack.base_url, api_key(stack.env, name), name) for name in users)
        theirs = _session(other)
        assert other.run("x = 'theirs'", session=theirs)["status"] == "completed"  # idle the longest
        mine = []
        for n in range(3):
            mine.append(_session(maker))
            assert maker.run(f"x = {n}", session=mine[-1])["status"] == "completed"
        assert maker.get(f"/api/v1/sessions/{mine[0]}").json()["status"] == "expired"
        assert other.run("print(x)", session=theirs)["stdout"] == "theirs\n"
        assert [maker.run("print(x)", session=s)["stdout"] for s in mine[1:]] == ["1\n", "2\n"]
