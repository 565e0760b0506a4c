"""Warm sandboxes: started before their job, used once, nothing carried from one job to the next."""

import time

from execution.sandbox.pool import WarmPool
from tests.conftest import Api

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
