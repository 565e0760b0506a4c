"""An operator's bad configuration: every variable settings read is checked at start-up, and a bad
one stops every process (manage.py, a Celery worker, the web) with one line naming it and what it
takes, never a traceback and never a value quietly read as something else."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.stack import BIN, ROOT, free_port


@pytest.fixture
def base_env(tmp_path: Path) -> dict[str, str]:
    """The test process's environment without our PTC_ tuning: each test adds the values it tries."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "PTC_", "DJANGO_"))}
    env.update(DJANGO_SETTINGS_MODULE="ptcproject.settings", PTC_DATA_DIR=str(tmp_path / "data"))
    return env


def run(env: dict[str, str], *command: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(command), cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def check(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return run(env, sys.executable, "manage.py", "check")


def setting(env: dict[str, str], name: str) -> str:
    """Return repr() of one setting as a process started with ``env`` reads it."""
    code = f"import django; django.setup(); from django.conf import settings; print(repr(settings.{name}))"
    result = run(env, sys.executable, "-c", code)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def assert_one_line_each(result: subprocess.CompletedProcess[str], variables: list[str]) -> None:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("ImproperlyConfigured: ")]
    for variable in variables:
        assert any(line.startswith(f"ImproperlyConfigured: {variable}") for line in lines), (variable, result.stderr[-3000:])


BAD = {
    # not a number
    "PTC_EXEC_CONCURRENCY": "eight",
    "PTC_REAP_EVERY": "2 minutes",  # environ's float read this as 2.0
    "PTC_RETENTION_DAYS": "a week",
    # negative
    "PTC_TOOLS_CONCURRENCY": "-4",
    "PTC_SANDBOX_POOL_SIZE": "-1",
    "PTC_MAX_TOOL_OUTPUT_BYTES": "-1",
    "PTC_DB_PREPARE_AFTER": "-1",  # was quietly read as 0, which turns preparing off
    "PTC_TIMEOUT_CEILING": "-5",
    # zero where it turns a limit off or spins
    "PTC_QUEUED_MAX_SECONDS": "0",  # the reaper would fail every queued job at once
    "PTC_RETENTION_EVERY": "0",
    "PTC_DB_CONNECT_TIMEOUT": "0",  # libpq: wait for ever
    "PTC_MCP_SESSIONS_PER_USER": "0",
    "PTC_BROKER_POP_MOST": "0",  # read only on Redis: the embedded default took anything
    # absurdly large, or not finite
    "PTC_METRICS_PORT": "99999",
    "PTC_EVENTS_HEARTBEAT_SECONDS": "nan",
    "PTC_SESSION_IDLE_TIMEOUT": "inf",
    # not a boolean, not a level
    "DJANGO_DEBUG": "maybe",  # environ reads any unknown word as false
    "PTC_TOOLS_TASK_EVENTS": "sometimes",
    "PTC_LOG_LEVEL": "loud",
    # wrong URL scheme, or set but empty
    "CELERY_BROKER_URL": "amqp://guest@localhost//",
    "REDIS_URL": "http://127.0.0.1:6379/0",
    "DATABASE_URL": "",
    "PTC_PUBLIC_URL": "127.0.0.1:8000",
    "DJANGO_CSRF_TRUSTED_ORIGINS": "https://ptc.example.com,ptc.example.com",  # never matched: admin forms 403
    # a relative path each process would resolve in its own working directory
    "PTC_SANDBOX_DIR": "ptc-sandbox",
}


def test_every_bad_variable_is_named_on_one_line_by_manage_py(base_env: dict[str, str]) -> None:
    result = check({**base_env, **BAD})
    assert_one_line_each(result, list(BAD))
    assert "got 'eight'" in result.stderr


@pytest.mark.parametrize(
    ("values", "named"),
    [
        ({"PTC_JOB_HEARTBEAT_SECONDS": "10", "PTC_JOB_LEASE_SECONDS": "5"}, "PTC_JOB_LEASE_SECONDS"),
        # a call over HTTP's slot given up before its bridge looks for its record (three beats)
        ({"PTC_JOB_HEARTBEAT_SECONDS": "20", "PTC_JOB_LEASE_SECONDS": "120"}, "PTC_JOB_HEARTBEAT_SECONDS"),
        ({"PTC_DB_POOL_MIN": "30", "PTC_DB_POOL_MAX": "10"}, "PTC_DB_POOL_MAX"),
        ({"PTC_SESSION_IDLE_TIMEOUT": "7200"}, "PTC_SESSION_IDLE_TIMEOUT"),
        ({"DJANGO_ALLOWED_HOSTS": ""}, "DJANGO_ALLOWED_HOSTS"),
        # every worker consumes maintenance (beat's rounds), an exec worker too: it would run the calls
        ({"PTC_TOOLS_QUEUES": "tools,maintenance"}, "PTC_TOOLS_QUEUES"),
    ],
)
def test_values_that_contradict_each_other_stop_start_up(base_env: dict[str, str], values: dict[str, str], named: str) -> None:
    assert_one_line_each(check({**base_env, **values}), [named])


def test_the_longest_heartbeat_a_call_over_https_slot_outlasts_starts(base_env: dict[str, str]) -> None:
    """Three beats of 19 s fit in the 60 s a call over HTTP's slot is kept past its tool's timeout."""
    assert (
        setting({**base_env, "PTC_JOB_HEARTBEAT_SECONDS": "19", "PTC_JOB_LEASE_SECONDS": "60"}, "PTC_JOB_HEARTBEAT_SECONDS")
        == "19"
    )


def test_a_data_dir_that_cannot_be_made_is_named(base_env: dict[str, str]) -> None:
    assert_one_line_each(check({**base_env, "PTC_DATA_DIR": "/proc/no-such-place"}), ["PTC_DATA_DIR"])


def test_the_metrics_folder_and_the_trace_endpoint_are_checked_too(base_env: dict[str, str], tmp_path: Path) -> None:
    """Read by prometheus_client and OpenTelemetry, not by us: a missing folder was a
    FileNotFoundError traceback from prometheus_client in every process."""
    bad = {"PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "missing"), "OTEL_EXPORTER_OTLP_ENDPOINT": "otel-collector:4318"}
    assert_one_line_each(check({**base_env, **bad}), list(bad))
    good = {"PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "OTEL_EXPORTER_OTLP_ENDPOINT": ""}
    assert check({**base_env, **good}).returncode == 0


@pytest.mark.parametrize("blank", ["", " "])
def test_a_metrics_folder_set_but_blank_is_named(base_env: dict[str, str], tmp_path: Path, blank: str) -> None:
    """A template's empty value (compose's ${PROMETHEUS_MULTIPROC_DIR:-}): prometheus_client takes a
    variable that is there for set, and every process wrote its files into its working directory
    (""), or failed at its first metric with a traceback (" "), while /metrics read one process."""
    work = tmp_path / "work"
    work.mkdir()
    result = subprocess.run(
        [sys.executable, str(ROOT / "manage.py"), "check"],
        cwd=work,
        env={**base_env, "PROMETHEUS_MULTIPROC_DIR": blank, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert_one_line_each(result, ["PROMETHEUS_MULTIPROC_DIR"])
    assert not list(work.glob("*.db"))


def test_numbers_read_as_written(base_env: dict[str, str]) -> None:
    assert setting({**base_env, "PTC_REAP_EVERY": "1e3"}, "PTC_REAP_EVERY") == "1000.0"  # was 13.0
    assert setting({**base_env, "PTC_RETENTION_DAYS": "0"}, "PTC_RETENTION_DAYS") == "0"
    assert setting({**base_env, "PTC_RETENTION_DAYS": ""}, "PTC_RETENTION_DAYS") == "None"


def test_lists_and_the_metrics_token_are_read_without_blanks(base_env: dict[str, str]) -> None:
    """environ's list kept each item's blanks: " localhost" matched no Host (every request 400),
    " tools" made PTC_TOOLS_QUEUES "not list 'tools'"; a repeated queue was scraped twice. A
    metrics token from a file kept its newline, and no scrape matched it (401)."""
    env = {
        **base_env,
        "DJANGO_ALLOWED_HOSTS": "ptc.example.com, localhost,",
        "DJANGO_CSRF_TRUSTED_ORIGINS": "https://ptc.example.com, https://admin.example.com",
        "PTC_TOOLS_QUEUES": " tools , tools.slow, tools",
        "PTC_METRICS_TOKEN": "s3cret\n",
    }
    assert setting(env, "ALLOWED_HOSTS") == repr(["ptc.example.com", "localhost"])
    assert setting(env, "CSRF_TRUSTED_ORIGINS") == repr(["https://ptc.example.com", "https://admin.example.com"])
    assert setting(env, "PTC_TOOLS_QUEUES") == repr(["tools", "tools.slow"])
    assert setting(env, "PTC_METRICS_TOKEN") == repr("s3cret")


def test_redis_url_alone_is_the_broker_too(base_env: dict[str, str]) -> None:
    """README: "Give it DATABASE_URL and REDIS_URL (or CELERY_BROKER_URL)", and the stdio MCP config
    gives only those two: the broker left on the filesystem queued jobs where no worker looked."""
    env = {k: v for k, v in base_env.items() if k != "CELERY_BROKER_URL"}
    env["REDIS_URL"] = os.environ["REDIS_URL"]
    assert setting(env, "CELERY_BROKER_URL") == repr(os.environ["REDIS_URL"])
    assert setting(env, "EMBEDDED") == "False"


def test_a_worker_and_the_web_stop_at_once_naming_the_variable(base_env: dict[str, str]) -> None:
    env = {**base_env, "PTC_EXEC_CONCURRENCY": "0"}  # Celery read 0 as "one per CPU"
    worker = run(env, str(BIN / "celery"), "-A", "ptcproject", "worker", "-Q", "exec", "-n", "hostile@%h", timeout=30)
    assert_one_line_each(worker, ["PTC_EXEC_CONCURRENCY"])
    web = run(env, str(BIN / "uvicorn"), "ptcproject.asgi:application", "--port", "0", timeout=30)
    assert_one_line_each(web, ["PTC_EXEC_CONCURRENCY"])


def test_the_web_with_several_workers_stops_too(base_env: dict[str, str]) -> None:
    """README: `uvicorn ptcproject.asgi:application --workers 2`. uvicorn's supervisor started each
    worker again as it exited, printing the same line twice a second, and never stopped."""
    env = {**base_env, "PTC_REAP_EVERY": "2 minutes"}
    web = run(env, str(BIN / "uvicorn"), "ptcproject.asgi:application", "--port", "0", "--workers", "2", timeout=30)
    # Stopped (uvicorn's parent exits 0 whatever its workers did), with the line and no traceback.
    assert "Traceback" not in web.stderr, web.stderr[-3000:]
    assert "ImproperlyConfigured: PTC_REAP_EVERY must be a number" in web.stderr
    assert "failed to start, stopping the parent process" in web.stderr


def test_a_metrics_port_that_is_taken_is_one_line(base_env: dict[str, str]) -> None:
    """Two workers on one host with one PTC_METRICS_PORT: the second logged a traceback from a
    Celery signal handler ("Signal handler raised: OSError"), and nothing said what to change."""
    with socket.socket() as holder:
        holder.bind(("0.0.0.0", 0))
        holder.listen()
        port = holder.getsockname()[1]
        # On the embedded broker (PTC_DATA_DIR): no queue or binding of it is left in the tests' Redis.
        env = {k: v for k, v in base_env.items() if k not in ("DATABASE_URL", "REDIS_URL", "CELERY_BROKER_URL")}
        env["PTC_METRICS_PORT"] = str(port)
        argv = [str(BIN / "celery"), "-A", "ptcproject", "worker", "-Q", "tools", "-n", f"taken-{port}@%h", "-l", "info"]
        worker = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines: list[str] = []
        try:
            assert worker.stdout is not None
            # Celery logs "ready." once every worker_ready handler has run (or raised).
            while (line := worker.stdout.readline()) and " ready." not in line:
                lines.append(line)
        finally:
            worker.terminate()
            worker.wait(30)
    log = "".join(lines)
    assert f"this worker serves no metrics: PTC_METRICS_PORT {port} can't be opened" in log, log[-3000:]
    assert "Traceback" not in log, log[-3000:]


def test_a_database_that_cannot_be_reached_is_one_line_from_manage_py(base_env: dict[str, str]) -> None:
    """The README's commands (migrate, create_api_key, check_ledger, ptc_rotate_secrets) ended in a
    traceback through psycopg's pool that said only "couldn't get a connection after 2.00 sec"."""
    port = free_port()  # nothing listens there
    env = {**base_env, "DATABASE_URL": f"postgres://postgres@127.0.0.1:{port}/ptc"}
    for command in (["migrate", "--no-input"], ["create_api_key", "alice", "--create-user"], ["check_ledger"]):
        result = run(env, sys.executable, "manage.py", *command)
        assert result.returncode != 0
        assert "Traceback" not in result.stderr, result.stderr[-3000:]
        (line,) = result.stderr.strip().splitlines()
        assert line.startswith(f"manage.py {command[0]}: cannot reach the database at 127.0.0.1:{port} (DATABASE_URL): ")
        assert "refused" in line, line


@pytest.mark.parametrize("shared", [False, True], ids=["alone", "with_a_shared_directory"])
def test_the_web_with_several_workers_says_when_its_metrics_are_one_workers(
    base_env: dict[str, str], tmp_path: Path, shared: bool
) -> None:
    """README: `uvicorn ptcproject.asgi:application --workers 2`. Each worker counts in its own
    memory: without PROMETHEUS_MULTIPROC_DIR a scrape reads one of them, and nothing said so."""
    env = {**base_env, **({"PROMETHEUS_MULTIPROC_DIR": str(tmp_path)} if shared else {})}
    argv = [str(BIN / "uvicorn"), "ptcproject.asgi:application", "--port", str(free_port()), "--workers", "2"]
    web = subprocess.Popen(argv, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True, start_new_session=True)
    lines: list[str] = []
    try:
        assert web.stderr is not None
        while sum("Application startup complete" in line for line in lines) < 2:
            line = web.stderr.readline()
            assert line, "".join(lines)[-3000:]
            lines.append(line)
    finally:
        os.killpg(web.pid, 15)
        web.wait(30)
    said = sum("set PROMETHEUS_MULTIPROC_DIR" in line for line in lines)
    assert said == (0 if shared else 2), "".join(lines)[-3000:]
