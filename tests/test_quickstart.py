"""The README's run command, on the embedded default: SQLite and a server-less broker."""

import contextlib
import os
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path

import psycopg

from tests.servers import redis_keys_drop
from tests.stack import ROOT, free_port


def test_quickstart_runs_a_demo_job_embedded(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "CELERY_BROKER_URL", "REDIS_URL")}
    env.update(PTC_DATA_DIR=str(tmp_path / "var"), PORT=str(free_port()), PTC_QUICKSTART_ONCE="1")
    result = subprocess.run(["scripts/run.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    key = lines[lines.index("== the demo user's API key (shown once):") + 1]
    assert key.startswith("ptc_")
    assert "embedded: SQLite" in result.stdout
    assert "status: completed   return value: 16   tool calls: 5" in result.stdout
    assert (tmp_path / "var" / "db.sqlite3").exists()


def _embedded_env(tmp_path: Path, port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "CELERY_BROKER_URL", "REDIS_URL")}
    env.update(PTC_DATA_DIR=str(tmp_path / "var"), PORT=str(port), PTC_QUICKSTART_ONCE="1")
    return env


def test_quickstart_on_a_port_another_process_holds_stops_at_once_saying_so(tmp_path: Path) -> None:
    # It started the stack, whose web process died at its start, and waited 60 s for it to answer.
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        started = time.monotonic()
        result = subprocess.run(
            ["scripts/run.sh"], cwd=ROOT, env=_embedded_env(tmp_path, port), capture_output=True, text=True, timeout=120
        )
    assert result.returncode != 0
    assert f"make run: port {port} is taken" in result.stderr, result.stderr
    assert time.monotonic() - started < 30
    assert not (tmp_path / "var" / "log" / "web.log").exists()  # nothing was started


def test_quickstart_on_postgres_creates_its_database_or_says_in_a_line_why_it_cannot(tmp_path: Path) -> None:
    server = os.environ["TEST_DATABASE_URL"].rsplit("/", 1)[0]
    name = f"ptc_quickstart_{uuid.uuid4().hex[:8]}"
    env = _embedded_env(tmp_path, free_port())
    env.update(DATABASE_URL=f"{server}/{name}", REDIS_URL=os.environ["REDIS_URL"], PTC_REDIS_PREFIX=f"{name}:")
    try:
        result = subprocess.run(["scripts/run.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
        assert result.returncode == 0, result.stdout + result.stderr
        assert f"== created the database '{name}'" in result.stdout
        assert "status: completed   return value: 16   tool calls: 5" in result.stdout
    finally:
        with psycopg.connect(os.environ["TEST_DATABASE_URL"], autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        redis_keys_drop(os.environ["REDIS_URL"], f"{name}:")

    env.update(DATABASE_URL=f"postgres://postgres@127.0.0.1:{free_port()}/{name}")  # no server there
    result = subprocess.run(["scripts/run.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    [said] = [line for line in result.stderr.splitlines() if line.startswith("make run:")]
    assert said.startswith("make run: cannot reach the database at 127.0.0.1:"), result.stderr
    assert "Traceback" not in result.stderr


def test_quickstart_reads_the_database_url_as_the_settings_do(tmp_path: Path) -> None:
    # A query string of Django's settings (conn_max_age, which settings.py takes) was handed to
    # libpq whole: it refused it, and make run stopped with psycopg's traceback before migrate.
    env = _embedded_env(tmp_path, free_port())
    env.update(DATABASE_URL=f"postgres://postgres@127.0.0.1:{free_port()}/ptc?conn_max_age=600")  # no server there
    result = subprocess.run(["scripts/run.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr
    [said] = [line for line in result.stderr.splitlines() if line.startswith("make run:")]
    assert said.startswith("make run: cannot reach the database at 127.0.0.1:"), result.stderr


def test_quickstart_on_a_port_that_is_not_one_says_so_in_a_line(tmp_path: Path) -> None:
    env = {**_embedded_env(tmp_path, 0), "PORT": "80a"}  # was a traceback from the port's probe
    result = subprocess.run(["scripts/run.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "make run: PORT must be a port number (1-65535), not '80a'" in result.stderr
    assert "Traceback" not in result.stderr


def _children(pid: int) -> dict[int, str]:
    """The processes whose parent is ``pid``: their command lines."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rpartition(")")[2].split()[1]) == pid:
                found[int(stat.parent.name)] = stat.with_name("cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError, IndexError):
            continue
    return found


def _quickstart_up(tmp_path: Path, until: str = "Ctrl-C stops everything.") -> tuple[subprocess.Popen[str], dict[int, str]]:
    """``make run``'s script, up to the line ``until`` (by default, past its demo job, waiting for
    Ctrl-C), and its four processes."""
    env = _embedded_env(tmp_path, free_port())
    del env["PTC_QUICKSTART_ONCE"]
    run = subprocess.Popen(["scripts/run.sh"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert run.stdout is not None
    for line in run.stdout:
        if until in line:
            break
    else:
        raise AssertionError(f"make run did not come up: {run.communicate()[1]}")
    # Its four, not what it runs beside them (the demo job's client, the sleep that bounds its wait).
    children = {pid: cmd for pid, cmd in _children(run.pid).items() if "bin/uvicorn" in cmd or "bin/celery" in cmd}
    assert sorted("uvicorn" if "bin/uvicorn" in cmd else "celery" for cmd in children.values()) == ["celery"] * 3 + ["uvicorn"]
    return run, children


def _killed(run: subprocess.Popen[str], children: dict[int, str], name: str) -> str:
    """Kill the quickstart's process whose command line holds ``name``; return what the script said
    as it stopped (it, and the rest, are killed after 60 s if still up: the assertions say so)."""
    os.kill(next(pid for pid, cmd in children.items() if name in cmd), signal.SIGKILL)
    try:
        _, stderr = run.communicate(timeout=60)
    finally:
        run.kill()
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        run.wait()
    return stderr


def test_quickstart_stops_everything_on_ctrl_c(tmp_path: Path) -> None:
    run, children = _quickstart_up(tmp_path)
    run.send_signal(signal.SIGINT)  # what the terminal's Ctrl-C sends it (its processes are in sessions of their own)
    _, stderr = run.communicate(timeout=60)
    assert run.returncode == 130, stderr
    assert not [pid for pid in children if Path(f"/proc/{pid}").exists()]


def test_quickstart_stops_everything_when_one_of_its_processes_dies(tmp_path: Path) -> None:
    """The web process killed while the quickstart runs: it said nothing, and the workers and beat
    ran on behind a dead API until Ctrl-C."""
    run, children = _quickstart_up(tmp_path)
    stderr = _killed(run, children, "bin/uvicorn")
    assert run.returncode == 1
    assert "make run: the web process stopped; the end of" in stderr, stderr
    assert not [pid for pid in children if Path(f"/proc/{pid}").exists()]


def test_quickstart_stops_everything_when_a_process_dies_before_it_waits(tmp_path: Path) -> None:
    """beat killed during the demo job, before the script waits: bash's ``wait -n`` waits for the
    next process to stop, never one that stopped before it was called, and the script hung there."""
    run, children = _quickstart_up(tmp_path, until="== running a demo job")
    stderr = _killed(run, children, " beat ")
    assert run.returncode == 1
    assert "make run: the beat process stopped; the end of" in stderr, stderr
