"""A real stack for integration tests: Celery exec and tools workers and uvicorn, as operators run them.

Each process is started with the exact commands of ARCHITECTURE.md, on the test database and Redis,
and stopped at the end of the session.
"""

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
# Runs kept under test-artifacts/, the newest first; test-artifacts/latest is this run's.
KEEP_RUNS = 5


def _run_folder() -> Path:
    """This run's folder for its processes' logs and screenshots: two runs in one checkout at once
    (a test session and a benchmark) each read their own logs, not the other's "ready" lines."""
    root = ROOT / "test-artifacts"
    folder = root / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    folder.mkdir(parents=True, exist_ok=True)
    runs = sorted((p for p in root.iterdir() if p.is_dir() and not p.is_symlink() and p.name[:8].isdigit()), reverse=True)
    for old in runs[KEEP_RUNS:]:
        shutil.rmtree(old, ignore_errors=True)
    link = root / f".latest-{os.getpid()}"
    link.unlink(missing_ok=True)
    link.symlink_to(folder.name)
    link.replace(root / "latest")
    return folder


ARTIFACTS = _run_folder()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Process:
    """One long-running process whose output goes to a log file in this run's folder (ARTIFACTS)."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], ready: str | None = None) -> None:
        self.name, self.argv, self.env, self.ready = name, argv, env, ready
        self.log = ARTIFACTS / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60) -> None:
        ARTIFACTS.mkdir(exist_ok=True)
        offset = self.log.stat().st_size if self.log.exists() else 0
        handle = self.log.open("ab")
        self.proc = subprocess.Popen(self.argv, cwd=ROOT, env=self.env, stdout=handle, stderr=subprocess.STDOUT)
        handle.close()
        if self.ready is None:
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:  # start-up only; nothing here is on a tested path
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; see {self.log}")
            with self.log.open("rb") as f:
                f.seek(offset)
                if self.ready.encode() in f.read():
                    return
            time.sleep(0.1)
        raise RuntimeError(f"{self.name} was not ready within {timeout} s; see {self.log}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def kill(self) -> None:
        self.stop(signal.SIGKILL)


class Stack:
    """The processes of one deployment. ``name`` tells apart the logs of several stacks in one run."""

    def __init__(self, env: dict[str, str], name: str = "") -> None:
        self.env = env
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        celery = str(BIN / "celery")
        self.exec_worker = Process(
            "exec-worker",
            [celery, "-A", "ptcproject", "worker", "-Q", "exec", "-n", f"exec-{os.getpid()}@%h", "-l", "info"],
            env,
            ready=" ready.",
        )
        self.tools_worker = Process(
            "tools-worker",
            [celery, "-A", "ptcproject", "worker", "-Q", "tools", "-n", f"tools-{os.getpid()}@%h", "-l", "info"],
            env,
            ready=" ready.",
        )
        self.beat = Process(
            "beat",
            [celery, "-A", "ptcproject", "beat", "-l", "info", "-s", str(ARTIFACTS / f"beat-{os.getpid()}")],
            env,
            ready="beat: Starting",
        )
        self.web = Process(
            "web",
            [str(BIN / "uvicorn"), "ptcproject.asgi:application", "--port", str(self.port), "--no-access-log"],
            env,
            ready="Uvicorn running",
        )
        self.processes = [self.exec_worker, self.tools_worker, self.beat, self.web]
        for process in self.processes:
            if name:
                process.name = f"{name}-{process.name}"
                process.log = process.log.with_name(f"{process.name}.log")

    def start(self, beat: bool = True, exec_worker: bool = True) -> None:
        left_out = {self.beat: not beat, self.exec_worker: not exec_worker}
        for process in self.processes:
            if not left_out.get(process):
                process.start()

    def stop(self) -> None:
        for process in reversed(self.processes):
            process.stop()


def process_names() -> list[str]:
    """The names of this host's processes (``/proc/<pid>/comm``): a job's code may name its own."""
    names = []
    for comm in Path("/proc").glob("[0-9]*/comm"):
        with contextlib.suppress(OSError):
            names.append(comm.read_text().strip())
    return names


def peak_reset(pid: int) -> int:
    """Start process ``pid``'s peak resident size (``VmHWM``) again from its size now; return that
    size, in MiB: ``peak_mb(pid)`` minus it is how far it rose since."""
    now = _status_mb(pid, "VmRSS")
    with open(f"/proc/{pid}/clear_refs", "w") as refs:
        refs.write("5")
    return now


def peak_mb(pid: int) -> int:
    """Process ``pid``'s peak resident size since it started, or since ``peak_reset``, in MiB."""
    return _status_mb(pid, "VmHWM")


def _status_mb(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as status:
        return int(next(line for line in status if line.startswith(f"{field}:")).split()[1]) // 1024


def sandboxes_of(pid: int) -> list[str]:
    """The live sandboxes under process ``pid`` (a worker): the pids of their outermost processes,
    which the fork server names ``ptc-sandbox``."""
    children: dict[int, list[int]] = {}
    names: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue
        name, rest = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()
        if rest[0] == "Z":
            continue
        names[int(entry)] = name
        children.setdefault(int(rest[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            todo.append(child)
            if names[child] == "ptc-sandbox":
                found.append(str(child))
    return found
