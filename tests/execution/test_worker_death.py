"""A job whose exec worker dies does not stay running: it ends as WorkerLost, and its sandbox dies."""

import subprocess
import time

from tests.conftest import Api
from tests.stack import Stack


def _wait_for(api: Api, job_id: str, statuses: set[str], seconds: float) -> dict:
    deadline = time.monotonic() + seconds
    while True:
        job = api.get(f"/api/v1/exec/{job_id}").json()
        if job["status"] in statuses or time.monotonic() > deadline:
            return job
        time.sleep(0.1)


def test_job_of_a_killed_worker_ends_as_worker_lost(api: Api, stack: Stack) -> None:
    code = "import time\nprint('working', flush=True)\ntime.sleep(120)"
    job = api.run(code, toolsets=["demo"], wait=0, timeout=200)
    assert _wait_for(api, job["id"], {"running"}, 15)["status"] == "running"
    stack.exec_worker.kill()  # SIGKILL: no cleanup, no goodbye
    time.sleep(0.5)
    # The sandbox died with its worker (bwrap --die-with-parent tears its PID namespace down).
    left = subprocess.run(["pgrep", "-f", "/opt/ptc/bin/guest.py"], capture_output=True, text=True).stdout.split()
    assert left == []
    stack.exec_worker.start()  # as a supervisor would; beat's reaper runs on it
    final = _wait_for(api, job["id"], {"failed"}, 20)
    assert final["status"] == "failed"
    assert final["error"]["type"] == "WorkerLost"
    assert final["finished_at"] is not None
    assert api.run("'back'", toolsets=["demo"])["return_value"] == "back"
