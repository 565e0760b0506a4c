"""Redis full (its maxmemory reached, noeviction): new work is refused with a clear error, work under
way ends with one, nothing is left half-written, and once there is room again the stack goes on."""

import os
import shlex
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import redis as redis_py

from ptcproject.accounts.services import user_with_key_create
from tests.conftest import REDIS_PREFIX
from tests.servers import RedisServer
from tests.stack import BIN, Process, Stack, free_port


def _fill(url: str) -> redis_py.Redis:
    """Make the Redis at ``url`` full: its maxmemory below what it holds, noeviction (Redis's default)."""
    server = redis_py.Redis.from_url(url)
    server.config_set("maxmemory-policy", "noeviction")
    server.config_set("maxmemory", "1")
    return server


SLOW_CALLS = """
import time
from ptc_tools.demo import Demo
out = []
for i in range(40):
    out.append(Demo.add(a=i, b=1))
    time.sleep(0.1)
out
"""


def test_while_redis_is_full_work_is_refused_saying_so_and_the_stack_goes_on_after(
    redis_stack: tuple[RedisServer, Stack],
) -> None:
    from execution.models import ExecJob

    redis, stack = redis_stack
    username = f"full-{free_port()}"
    _, key = user_with_key_create(username=username, create_user=True, staff=False, credits=100)
    http = httpx.Client(base_url=stack.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=60)
    running = http.post("/api/v1/exec", json={"code": SLOW_CALLS, "toolsets": ["demo"], "wait": 0}).json()
    deadline = time.monotonic() + 30
    while len(http.get("/api/v1/tool-calls", params={"exec": running["id"]}).json()["results"]) < 3:
        assert time.monotonic() < deadline, "the job made no calls"
        time.sleep(0.1)
    server = _fill(redis.url)

    # New work: refused at once, saying why, and no job left queued behind the answer.
    refused = http.post("/api/v1/exec", json={"code": "print(1)", "toolsets": ["demo"], "wait": 10})
    assert refused.status_code == 503, refused.text
    error = refused.json()["error"]
    assert error["code"] == "broker_unavailable" and "full" in error["message"] and "maxmemory" in error["message"], error
    assert ExecJob.objects.filter(user__username=username).count() == 1  # the running one only

    # Work under way: its next call can't be queued; the job ends with that error, recorded whole.
    while (job := http.get(f"/api/v1/exec/{running['id']}").json())["status"] in ("queued", "running"):
        assert time.monotonic() < deadline + 30, "the job did not end"
        time.sleep(0.2)
    assert job["status"] == "failed" and job["error"]["code"] == "broker_unavailable", job["error"]
    assert "is full (Redis has reached its maxmemory)" in job["error"]["message"], job["error"]
    calls = http.get("/api/v1/tool-calls", params={"exec": running["id"], "page_size": 100}).json()["results"]
    completed = [call for call in calls if call["status"] == "completed"]
    assert [call["status"] for call in calls if call not in completed] == ["failed"]
    # Each call that ran charged once (Demo.add: 1 credit), the one refused nothing, nothing held.
    balance = http.get("/api/v1/billing/balance").json()
    assert (balance["balance"], balance["reserved"]) == (100 - len(completed), 0)

    # Every process outlived it (an exec worker died of its acks, refused in a MULTI) and, once Redis
    # has room again, takes work as before.
    assert [(process.name, process.proc.poll()) for process in stack.processes if process.proc] == [
        (process.name, None) for process in stack.processes if process.proc
    ]
    server.config_set("maxmemory", "0")
    again = http.post(
        "/api/v1/exec", json={"code": "from ptc_tools.demo import Demo\nDemo.add(a=1, b=2)", "toolsets": ["demo"], "wait": 30}
    )
    assert again.status_code == 201 and again.json()["return_value"] == 3, again.text


def _client(stack: Stack, credits: int = 100) -> httpx.Client:
    _, key = user_with_key_create(username=f"full-{free_port()}", create_user=True, staff=False, credits=credits)
    return httpx.Client(base_url=stack.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=60)


@contextmanager
def _tools_worker(stack: Stack, name: str, *extra: str) -> Iterator[Process]:
    """A tools worker of its own, named ``name`` (its direct queue is new to Redis), started without
    waiting for it to be ready; stopped after."""
    argv = [str(BIN / "celery"), "-A", "ptcproject", "worker", "-Q", "tools", "-n", f"{name}-{os.getpid()}@%h", "-l", "info"]
    worker = Process(f"redis-full-{name}", [*argv, *extra], stack.env)
    try:
        worker.start()
        yield worker
    finally:
        worker.stop()


def _logged(process: Process, text: str, seconds: float = 60) -> None:
    """Wait until ``process`` has logged ``text``, failing at once should it exit."""
    deadline = time.monotonic() + seconds
    while text not in process.log.read_text(errors="replace"):
        assert process.proc is not None and process.proc.poll() is None, f"{process.name} exited; see {process.log}"
        assert time.monotonic() < deadline, f"{process.name} did not log {text!r}; see {process.log}"
        time.sleep(0.2)


def _ended(http: httpx.Client, job_id: str, seconds: float = 60) -> dict:
    deadline = time.monotonic() + seconds
    while (job := http.get(f"/api/v1/exec/{job_id}").json())["status"] in ("queued", "running"):
        assert time.monotonic() < deadline, f"the job did not end: {job}"
        time.sleep(0.2)
    return job


def test_a_worker_started_while_redis_is_full_waits_for_room_then_runs_what_was_queued(
    redis_stack: tuple[RedisServer, Stack],
) -> None:
    """A worker started while Redis is full exited at its start (Celery's start-up writes to Redis),
    over and over under its supervisor. It now starts, says Redis is full, waits for the bindings
    it needs, and once there is room consumes: a job's call queued meanwhile runs, and the job ends."""
    redis, stack = redis_stack
    stack.tools_worker.stop()  # no tools worker: the job's call waits in its queue
    http = _client(stack)
    job = http.post(
        "/api/v1/exec", json={"code": "from ptc_tools.demo import Demo\nDemo.add(a=1, b=2)", "toolsets": ["demo"], "wait": 0}
    )
    assert job.status_code == 201, job.text
    server = redis_py.Redis.from_url(redis.url)
    deadline = time.monotonic() + 30
    while not server.llen(f"{REDIS_PREFIX}tools"):  # the call is in the queue, in Redis
        assert time.monotonic() < deadline, "the job's call was not queued"
        time.sleep(0.1)
    _fill(redis.url)
    with _tools_worker(stack, "late") as late:
        # Its direct queue (named after it) is new to Redis: it can't bind it, says so, and waits.
        _logged(late, "the broker is full (Redis has reached its maxmemory): this worker can't bind queue")
        assert late.proc is not None and late.proc.poll() is None
        assert http.get(f"/api/v1/exec/{job.json()['id']}").json()["status"] == "running"
        server.config_set("maxmemory", "0")
        done = _ended(http, job.json()["id"])
        assert done["status"] == "completed" and done["return_value"] == 3, done
        _logged(late, " ready.")
        assert late.proc.poll() is None


@dataclass
class _Held:
    """An exec worker of its own (one slot) that took two jobs while Redis was full, both without
    their unacked record: it runs ``busy`` (8 s) and holds ``waiting``, not started, in its memory."""

    worker: Process
    http: httpx.Client
    busy: dict
    waiting: dict
    server: redis_py.Redis


@contextmanager
def _jobs_held_while_full(redis: RedisServer, stack: Stack, name: str) -> Iterator[_Held]:
    """The stack's exec worker stopped, Redis full, and a worker of its own, named ``name`` (its log
    too), holding two jobs (_Held); after, it is stopped and Redis has room again."""
    stack.exec_worker.stop()
    argv = [str(BIN / "celery"), "-A", "ptcproject", "worker", "-Q", "exec", "-n", f"{name}-{os.getpid()}@%h", "-l", "info"]
    # One slot, two messages at a time: the second job is handed over, and waits for the slot.
    slots = Process(f"redis-full-{name}", [*argv, "-c", "1", "--prefetch-multiplier", "2"], stack.env, ready=" ready.")
    slots.start()  # once with room: its queues are bound
    slots.stop()
    http = _client(stack)
    busy = http.post("/api/v1/exec", json={"code": "import time\ntime.sleep(8)\n1", "wait": 0}).json()
    waiting = http.post("/api/v1/exec", json={"code": "1 + 2", "wait": 0}).json()
    server = redis_py.Redis.from_url(redis.url)
    deadline = time.monotonic() + 30
    while server.llen(f"{REDIS_PREFIX}exec") < 2:
        assert time.monotonic() < deadline, "the jobs were not queued"
        time.sleep(0.1)
    _fill(redis.url)
    try:
        slots.start()
        deadline = time.monotonic() + 60
        while slots.log.read_text(errors="replace").count("handed over without their unacked record") < 2:
            assert slots.proc is not None and slots.proc.poll() is None, f"the worker exited; see {slots.log}"
            assert time.monotonic() < deadline, f"the worker took no two jobs; see {slots.log}"
            time.sleep(0.1)
        while http.get(f"/api/v1/exec/{busy['id']}").json()["status"] != "running":
            assert time.monotonic() < deadline, "the first job did not start"
            time.sleep(0.1)
        assert http.get(f"/api/v1/exec/{waiting['id']}").json()["status"] == "queued"
        yield _Held(slots, http, busy, waiting, server)
    finally:
        slots.stop()
        server.config_set("maxmemory", "0")


def test_a_job_taken_while_redis_is_full_and_not_started_goes_back_to_its_queue_at_a_warm_shutdown(
    redis_stack: tuple[RedisServer, Stack],
) -> None:
    """A message a worker takes while Redis is full is handed over without its unacked record (Redis
    refuses it): a worker stopped (SIGTERM) before starting it lost it, a job left queued until the
    reaper failed it. It now goes back to its queue from the worker's memory, the worker waiting for
    room (saying so, with the job's id) if Redis is still full; another worker runs it."""
    redis, stack = redis_stack
    with _jobs_held_while_full(redis, stack, "warm") as held:
        assert held.worker.proc is not None
        held.worker.proc.send_signal(signal.SIGTERM)  # a warm shutdown: the running job ends first
        # Redis is still full: the second job can't go back yet, and the worker says so, naming it.
        _logged(held.worker, "NOT BACK YET")
        assert held.waiting["id"] in held.worker.log.read_text(errors="replace")
        held.server.config_set("maxmemory", "0")
        assert held.worker.proc.wait(60) == 0
        log = held.worker.log.read_text(errors="replace")
        assert "messages went back to their queue" in log and "LOST" not in log, log
    stack.exec_worker.start()
    assert _ended(held.http, held.busy["id"])["status"] == "completed"
    done = _ended(held.http, held.waiting["id"])
    assert done["status"] == "completed" and done["return_value"] == 3, done


def _put_back_command(line: str) -> list[str]:
    """The redis-cli command a worker's log line gives to put a message back."""
    command = shlex.split(line.split("put it back with: ", 1)[1])
    assert command[:2] == ["redis-cli", "RPUSH"], line
    return command


def test_a_worker_killed_while_it_waits_for_room_to_put_a_job_back_has_logged_how_to_put_it_back(
    redis_stack: tuple[RedisServer, Stack],
) -> None:
    """A worker waits restore_wait for a full Redis to take back a job it holds unrecorded, and only
    then logged it LOST with the command that puts it back: killed during the wait (its pod's grace
    period over), it logged nothing, and the job was gone without a trace. The command is logged
    as the wait starts; run, it puts the job back, and the job runs."""
    redis, stack = redis_stack
    with _jobs_held_while_full(redis, stack, "killed") as held:
        assert held.worker.proc is not None
        held.worker.proc.send_signal(signal.SIGTERM)
        _logged(held.worker, "NOT BACK YET")
        held.worker.proc.kill()
        held.worker.proc.wait(10)
        [line] = [line for line in held.worker.log.read_text(errors="replace").splitlines() if "NOT BACK YET" in line]
        assert held.waiting["id"] in line, line
        held.server.config_set("maxmemory", "0")
        command = _put_back_command(line)
        subprocess.run([command[0], "-u", redis.url, *command[1:]], check=True, capture_output=True)
    stack.exec_worker.start()
    done = _ended(held.http, held.waiting["id"])
    assert done["status"] == "completed" and done["return_value"] == 3, done


def test_a_cold_shutdown_does_not_wait_for_room_to_put_a_job_back(redis_stack: tuple[RedisServer, Stack]) -> None:
    """A cold shutdown (SIGQUIT) asked while a worker waits for a full Redis to take back a job it
    holds unrecorded waited on all the same, up to restore_wait (60 s). It stops waiting at once,
    and logs the job LOST, with the command that puts it back."""
    redis, stack = redis_stack
    with _jobs_held_while_full(redis, stack, "cold") as held:
        assert held.worker.proc is not None
        held.worker.proc.send_signal(signal.SIGTERM)
        _logged(held.worker, "NOT BACK YET")
        asked = time.monotonic()
        held.worker.proc.send_signal(signal.SIGQUIT)
        held.worker.proc.wait(30)
        assert time.monotonic() - asked < 10
        [lost] = [line for line in held.worker.log.read_text(errors="replace").splitlines() if "LOST: " in line]
        assert held.waiting["id"] in lost and "a cold shutdown does not wait" in lost, lost
        _put_back_command(lost)
