"""A job whose exec worker dies does not stay running: it ends as WorkerLost, and its sandbox dies."""

import time
from pathlib import Path

from tests.conftest import Api
from tests.stack import Stack, sandboxes_of


def _alive(pid: str) -> bool:
    """Running, not a zombie waiting for init to reap it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


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
    assert api.until_printed(job["id"]) == "working\n"
    assert stack.exec_worker.proc is not None
    worker_pid = stack.exec_worker.proc.pid
    sandboxes = sandboxes_of(worker_pid)  # the job's, and the warm pool's
    assert sandboxes, "the job's sandbox should be under the exec worker"
    stack.exec_worker.kill()  # SIGKILL: no cleanup, no goodbye
    time.sleep(0.5)
    # The sandboxes died with their worker: the fork server ends with its control socket, and its
    # PID namespace, which holds every sandbox, with it.
    assert [pid for pid in sandboxes if _alive(pid)] == []
    stack.exec_worker.start()  # as a supervisor would; beat's reaper runs on it
    final = _wait_for(api, job["id"], {"failed"}, 20)
    assert final["status"] == "failed"
    assert final["error"]["type"] == "WorkerLost"
    assert final["stdout"] == "working\n"  # printed before the kill: kept, from the job's events
    assert final["finished_at"] is not None
    assert api.run("'back'", toolsets=["demo"])["return_value"] == "back"
