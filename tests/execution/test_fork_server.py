"""The fork server: each sandbox is killed whole, its exit is reported, and a fork server that
died is started again. In this process, with no stack: the pool and jobs build on these."""

import contextlib
import os
import signal
import socket
import time
from pathlib import Path

import pytest

from execution.sandbox import process
from execution.sandbox.pool import sandbox_start
from tests.stack import sandboxes_of


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants."""
    found, todo = [pid], [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = list(Path(f"/proc/{parent}/task").iterdir())
            children = [int(child) for task in tasks for child in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):  # it ended meanwhile
            continue
        found += children
        todo += children
    return found


def _gone(pids: list[int], seconds: float = 5) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not any(_alive(pid) for pid in pids):
            return True
        time.sleep(0.02)
    return False


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_a_killed_sandbox_goes_whole_and_its_status_is_reported() -> None:
    sandbox = sandbox_start()
    assert sandbox.proc.pid is not None and str(sandbox.proc.pid) in sandboxes_of(os.getpid())
    deadline = time.monotonic() + 5
    while len(tree := _tree(sandbox.proc.pid)) < 3:  # the sandbox, its init and its runner
        assert time.monotonic() < deadline, f"the sandbox's processes: {tree}"
        time.sleep(0.01)
    sandbox.proc.kill()
    assert sandbox.proc.wait(5) == -9
    assert _gone(tree)
    sandbox.discard()


def test_a_sandbox_let_go_unused_exits_and_says_so() -> None:
    sandbox = sandbox_start()
    sandbox.bridge.close()  # the runner reads the end of its bridge before any job, and exits
    assert sandbox.proc.wait(5) == 0
    sandbox.discard()


def test_a_fork_server_that_died_is_started_again() -> None:
    running = sandbox_start()
    server = _fork_server()
    os.kill(server, 9)
    # Its sandboxes died with it, and are reported killed.
    assert running.proc.wait(5) == -9
    running.discard()
    later = sandbox_start()
    try:
        assert later.proc.poll() is None
        later.bridge.close()
        assert later.proc.wait(5) == 0
    finally:
        later.discard()


def _fork_server() -> int:
    """This process's fork server (not an exec worker's, which a test stack may have started)."""
    bwrap = process._fork_server._proc
    assert bwrap is not None
    servers = [pid for pid in _tree(bwrap.pid) if _is_fork_server(pid)]
    assert len(servers) == 1, servers
    return servers[0]


def _is_fork_server(pid: int) -> bool:
    """Named so, and not a sandbox it just forked (named so until it names itself)."""
    try:
        parent = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
        names = (Path(f"/proc/{pid}/comm").read_text().strip(), Path(f"/proc/{parent}/comm").read_text().strip())
        return names == ("ptc-fork-server", "bwrap")
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_the_workers_start_up_trial_passes_here() -> None:
    process.trial()  # what an exec worker runs before its pool: here, a sandbox sets itself up


def test_a_bad_request_is_refused_and_the_fork_server_serves_on() -> None:
    running = sandbox_start()
    control = process._fork_server._running()
    request = process.json.dumps({"op": "spawn", "id": -1}).encode()
    socket.send_fds(control, [request], [running.bridge.fileno()])  # one fd, not three
    later = sandbox_start()
    try:
        assert running.proc.poll() is None and later.proc.poll() is None
    finally:
        running.discard()
        later.discard()


def test_a_wedged_fork_server_is_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(process, "SPAWN_TIMEOUT", 1.0)
    monkeypatch.setattr(process, "REPORT_GRACE", 0.2)
    running = sandbox_start()
    server = _fork_server()
    os.kill(server, signal.SIGSTOP)
    try:
        running.proc.kill()  # its exit can't be reported: the wait gives up on the report
        assert running.proc.wait(5) == -9
        with pytest.raises(process.SandboxUnavailable, match="did not answer"):
            sandbox_start()
    finally:
        with contextlib.suppress(ProcessLookupError):  # killed for it, and reaped already
            os.kill(server, signal.SIGCONT)
    running.discard()
    assert _gone([server])  # killed for it
    later = sandbox_start()
    try:
        assert later.proc.poll() is None
    finally:
        later.discard()
