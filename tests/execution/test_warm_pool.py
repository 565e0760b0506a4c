"""Warm sandboxes: started before their job, used once, nothing carried from one job to the next."""

import time

from execution.sandbox import pool as pool_module
from execution.sandbox.pool import WarmPool
from tests.conftest import Api
from tests.stack import process_names

LEAVE_TRACES = """
import importlib, os, subprocess
open("/work/left-behind", "w").write("job one")
open("/tmp/left-behind", "w").write("job one")
import ptc_tools.demo  # its file is written as it is first imported
open("/opt/ptc/sdk/ptc_tools/demo.py", "a").write("\\nLEAKED = True\\n")
os.environ["LEFT_BEHIND"] = "1"
subprocess.Popen(["/usr/bin/sleep", "30"])
importlib.reload(ptc_tools.demo).LEAKED
"""

FIND_TRACES = """
import os, glob
import ptc_tools.demo
found = [p for p in ("/work/left-behind", "/tmp/left-behind") if os.path.exists(p)]
found += [k for k in os.environ if k == "LEFT_BEHIND"]
found += ["sdk"] if hasattr(ptc_tools.demo, "LEAKED") else []
procs = [open(p).read() for p in glob.glob("/proc/[0-9]*/cmdline")]
found += [c for c in procs if "sleep" in c]
found
"""


def _warm_job(api: Api, code: str) -> dict:
    """Run ``code`` until it lands in a warm sandbox (the pool fills in the background)."""
    deadline = time.monotonic() + 30
    while True:
        job = api.run(code, toolsets=["demo"])
        if job["status"] != "completed" or time.monotonic() > deadline:
            return job
        if api_job_warm(job):
            return job
        time.sleep(0.5)  # the worker just started: its pool is still filling


def api_job_warm(job: dict) -> bool:
    from execution.models import ExecJob

    return bool(ExecJob.objects.get(pk=job["id"]).timings.get("warm"))


def test_jobs_run_in_warm_sandboxes_and_leave_nothing_to_the_next(api: Api) -> None:
    first = _warm_job(api, LEAVE_TRACES)
    assert first["status"] == "completed", first["error"]
    assert first["return_value"] is True  # it changed its own SDK copy, and saw the change
    second = _warm_job(api, FIND_TRACES)
    assert second["status"] == "completed", second["error"]
    assert second["return_value"] == []
    assert api_job_warm(first) and api_job_warm(second)


def test_a_warm_sandbox_gets_the_jobs_own_sdk(api: Api) -> None:
    # Warm sandboxes are started before anyone knows the job's toolsets: the SDK comes with the job.
    job = _warm_job(api, "import ptc_tools.demo\nsorted(n for n in dir(ptc_tools.demo.Demo) if not n.startswith('_'))")
    assert job["status"] == "completed", job["error"]
    assert {"add", "echo", "sleep"} <= set(job["return_value"])
    none = api.run("import importlib.util\nimportlib.util.find_spec('ptc_tools.demo') is None", toolsets=[])
    assert none["status"] == "completed", none["error"]
    assert none["return_value"] is True


def _wait_ready(pool: WarmPool, count: int) -> None:
    deadline = time.monotonic() + 20
    while pool.ready() < count:
        assert time.monotonic() < deadline, f"the pool has {pool.ready()} of {count} sandboxes ready"
        time.sleep(0.05)


def test_the_pool_refills_discards_the_dead_and_kills_the_unused_when_closed() -> None:
    pool = WarmPool(2)
    pool.start()
    try:
        _wait_ready(pool, 2)
        taken = pool.take()
        assert taken.warm and taken.proc.poll() is None
        taken.discard()
        _wait_ready(pool, 2)  # refilled in the background

        # A warm sandbox that died while it waited is never handed out.
        dead = pool._ready[0]
        dead.proc.kill()
        dead.proc.wait()
        handed = pool.take()
        assert handed is not dead and handed.proc.poll() is None
        handed.discard()
        _wait_ready(pool, 2)
        waiting = list(pool._ready)
    finally:
        pool.close()
    assert all(sandbox.proc.poll() is not None for sandbox in waiting)
    cold = pool.take()  # a closed pool still gives sandboxes, started on demand
    try:
        assert not cold.warm and cold.proc.poll() is None
    finally:
        cold.discard()


def test_a_taken_sandboxs_place_is_filled_once_its_job_is_done_with_it_or_a_moment_after(monkeypatch) -> None:
    # Its job's end is not slowed by the next sandbox's start: the pool waits for the discard, but
    # never longer than REFILL_AFTER_SECONDS (a long job, or a session's sandbox, kept for hours).
    # Taken when that is ten minutes, its place is filled for its discard, not by the clock: a count
    # of sandboxes ready, where a time under 1.5 s was what a loaded machine's sandbox start made it.
    monkeypatch.setattr(pool_module, "REFILL_AFTER_SECONDS", 600)
    pool = WarmPool(2)
    pool.start()
    try:
        _wait_ready(pool, 2)
        taken = pool.take()
        time.sleep(0.5)  # a sandbox starts in milliseconds: had it been wanted, it would be ready
        assert pool.ready() == 1
        taken.discard()
        _wait_ready(pool, 2)

        monkeypatch.setattr(pool_module, "REFILL_AFTER_SECONDS", 1.5)
        held = pool.take()
        started = time.monotonic()
        _wait_ready(pool, 2)  # not discarded, and its place is filled anyway
        assert 1.3 < time.monotonic() - started < 10
        held.discard()
        time.sleep(0.5)
        assert pool.ready() == 2  # its discard, later, asks for no more than the pool's size
    finally:
        pool.close()


def test_a_jobs_sandbox_is_killed_once_its_job_has_ended(api: Api) -> None:
    # Its result given, it waits for its job's end to be announced, then it is killed: a thread of
    # the code still sleeping does not keep it alive. Each job names its runner, seen from outside.
    names = [f"ptc-spent-{n}" for n in range(3)]
    for name in names:
        code = f"import threading, time\nthreading.Thread(target=time.sleep, args=(60,)).start()\nopen('/proc/self/comm', 'w').write({name!r})"
        job = api.run(code)
        assert job["status"] == "completed", job["error"]
    deadline = time.monotonic() + 10
    while left := [name for name in process_names() if name in names]:
        assert time.monotonic() < deadline, f"sandboxes left alive after their jobs: {left}"
        time.sleep(0.1)


def test_a_thread_that_goes_on_printing_does_not_hold_its_jobs_end(api: Api) -> None:
    # What the code printed before its result is read; what its threads print after is not waited
    # for (its sandbox lives on until the job's end is announced). A read that waited for the
    # pipes to fall quiet would wait here for the threads' CPU limit.
    code = (
        "import fcntl, os, threading\n"
        "print('before the result', flush=True)\n"
        "fcntl.fcntl(1, 1031, 1 << 20)  # F_SETPIPE_SZ: room for a megabyte between two reads\n"
        "def spam():\n"
        "    while True:\n"
        "        os.write(1, b'x' * 65536)\n"
        "for _ in range(3):\n"
        "    threading.Thread(target=spam, daemon=True).start()\n"
        "1"
    )
    started = time.monotonic()
    job = api.run(code, timeout=30)
    assert time.monotonic() - started < 10
    assert (job["status"], job["return_value"]) == ("completed", 1), job["error"]
    assert job["stdout"].startswith("before the result\n")  # the head of what it kept


FIND_WARM_UP = """
import os, threading
[sorted(os.listdir("/opt/ptc/sdk")), sorted(os.listdir("/work")), [t.name for t in threading.enumerate()]]
"""


def test_a_warm_sandboxs_warm_up_leaves_its_job_nothing(api: Api) -> None:
    # A warm sandbox takes the job's paths once while it waits (guest._warm_up): no file of it in
    # the SDK's folder or /work, no thread of it left beside the code's and the bridge's reader.
    job = _warm_job(api, FIND_WARM_UP)
    assert job["status"] == "completed", job["error"]
    assert api_job_warm(job)
    sdk, work, threads = job["return_value"]
    assert sdk == ["ptc_tools"]  # no .warm-up
    assert work == []
    assert sorted(threads) == ["MainThread", "ptc-bridge"]
