"""The sandbox reaches nothing but its bridge, and sees none of the worker's secrets."""

import pytest

from tests.conftest import WORKER_SECRET, Api


def test_cannot_read_the_workers_environment(api: Api) -> None:
    code = f"""
import os, glob
found = [k for k, v in os.environ.items() if "{WORKER_SECRET}" in v]
for path in glob.glob("/proc/*/environ"):
    try:
        if b"{WORKER_SECRET}" in open(path, "rb").read():
            found.append(path)
    except OSError:
        pass
(found, sorted(os.environ), len(glob.glob("/proc/[0-9]*")))
"""
    job = api.run(code, toolsets=["demo"])
    assert job["status"] == "completed", job["error"]
    found, names, pids = job["return_value"]
    assert found == []
    assert "PTC_TEST_WORKER_SECRET" not in names
    assert "DATABASE_URL" not in names
    assert pids <= 3  # its own PID namespace: the sandbox's init, the runner, maybe a child


@pytest.mark.parametrize("port", [6379, 5432])
def test_cannot_connect_to_local_services(api: Api, port: int) -> None:
    code = f"""
import socket
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=2)
    outcome = "connected"
except OSError as exc:
    outcome = type(exc).__name__
outcome
"""
    job = api.run(code, toolsets=["demo"])
    assert job["status"] == "completed", job["error"]
    assert job["return_value"] != "connected"


def test_raw_syscall_socket_is_refused(api: Api) -> None:
    code = """
import ctypes, errno
libc = ctypes.CDLL(None, use_errno=True)
fd = libc.socket(2, 1, 0)  # AF_INET, SOCK_STREAM, straight through libc
(fd, ctypes.get_errno() == errno.EPERM)
"""
    job = api.run(code, toolsets=["demo"])
    assert job["status"] == "completed", job["error"]
    assert job["return_value"] == [-1, True]


def test_cannot_reach_unix_sockets_of_the_host(api: Api) -> None:
    code = """
import os
visible = [p for p in ("/var/run/postgresql", "/run/redis", "/tmp/.s.PGSQL.5432", "/root", "/etc/passwd", "/home")
           if os.path.exists(p)]
visible
"""
    job = api.run(code, toolsets=["demo"])
    assert job["status"] == "completed", job["error"]
    assert job["return_value"] == []


def test_runs_as_an_unprivileged_user_with_a_fresh_scratch_dir(api: Api) -> None:
    first = api.run("import os\nopen('left.txt', 'w').write('x')\n(os.getcwd(), os.getuid())", toolsets=["demo"])
    assert first["return_value"] == ["/work", 65534]
    second = api.run("import os\nos.listdir('.')", toolsets=["demo"])
    assert second["return_value"] == []
