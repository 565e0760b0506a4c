"""The sandbox reaches nothing but its bridge, and sees none of the worker's secrets."""

import time

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


def test_the_code_runs_without_privileges_under_its_filter(api: Api) -> None:
    code = """
status = dict(line.split(":\\t", 1) for line in open("/proc/self/status").read().splitlines() if ":\\t" in line)
{k: status[k].strip() for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb", "NoNewPrivs", "Seccomp")}
"""
    job = api.run(code, toolsets=["demo"])
    assert job["status"] == "completed", job["error"]
    zero = "0000000000000000"
    assert job["return_value"] == {
        "CapInh": zero,
        "CapPrm": zero,
        "CapEff": zero,
        "CapBnd": zero,
        "CapAmb": zero,
        "NoNewPrivs": "1",
        "Seccomp": "2",
    }


# Holds a file, an abstract socket, a pseudo-terminal and 200 processes while its siblings look for them. With one
# count of processes for all sandboxes, a sibling's 100 more would pass the limit of 256
# (PTC_MAX_PROCESSES).
HOLDER = """
import os, signal, socket, time
until = time.monotonic() + 8
open("/work/mine", "w").write("secret")
server = socket.socket(socket.AF_UNIX)
server.bind("\\0ptc-sibling")
server.listen()
terminal = os.openpty()
children = []
for _ in range(200):
    pid = os.fork()
    if pid == 0:
        signal.pause()
        os._exit(0)
    children.append(pid)
print("ready", flush=True)
time.sleep(max(0.0, until - time.monotonic()))
(open("/work/mine").read(), sum(os.waitpid(pid, os.WNOHANG)[0] == 0 for pid in children))
"""

LOOKER = """
import os, glob, random, signal, socket
seen = {"work": os.listdir("/work"), "pids": len(glob.glob("/proc/[0-9]*")), "random": random.getrandbits(64)}
seen["ptys"] = os.listdir("/dev/pts")
try:
    socket.socket(socket.AF_UNIX).connect("\\0ptc-sibling")
    seen["socket"] = "connected"
except OSError as exc:
    seen["socket"] = type(exc).__name__
children = []
for _ in range(100):
    pid = os.fork()
    if pid == 0:
        signal.pause()
        os._exit(0)
    children.append(pid)
seen["forked"] = len(children)
os.kill(-1, signal.SIGKILL)  # every process it may signal but itself: its own children only
seen
"""


def test_sibling_sandboxes_share_nothing(api: Api) -> None:
    holder = api.run(HOLDER, toolsets=["demo"], wait=0, timeout=60)
    assert api.until_printed(holder["id"]) == "ready\n"
    looks = [api.run(LOOKER, toolsets=["demo"], timeout=60) for _ in range(2)]
    for job in looks:
        assert job["status"] == "completed", job["error"]
        seen = job["return_value"]
        assert seen["work"] == []
        assert seen["pids"] <= 3  # its own init, its runner, the glob's listing: not the holder's 201
        assert seen["socket"] == "ConnectionRefusedError"
        assert seen["ptys"] == ["ptmx"]
        assert seen["forked"] == 100
    assert looks[0]["return_value"]["random"] != looks[1]["return_value"]["random"]
    deadline = time.monotonic() + 30
    while (ended := api.get(f"/api/v1/exec/{holder['id']}").json())["status"] in ("queued", "running"):
        assert time.monotonic() < deadline, "the holder should have ended"
        time.sleep(0.2)
    assert ended["status"] == "completed", ended["error"]
    assert ended["return_value"] == ["secret", 200]  # its file, and every one of its processes


def test_the_code_can_neither_interrupt_its_init_nor_read_the_fork_servers_state(api: Api) -> None:
    code = """
import os, signal, sys, time
os.kill(1, signal.SIGINT)  # its PID 1 has no handler: the kernel drops it
time.sleep(0.2)
frames, frame = [], sys._getframe()
while frame is not None:
    frames.append(frame.f_locals)
    frame = frame.f_back
servers = [v for f in frames for v in f.values() if hasattr(v, "children")]
(signal.getsignal(signal.SIGINT) is signal.default_int_handler,
 any("request" in f for f in frames),
 [dict(s.children) for s in servers])
"""
    job = api.run(code, toolsets=["demo"])
    assert job["status"] == "completed", job["error"]
    # Ctrl-C still raises KeyboardInterrupt in the code; no request of the fork server's, and
    # none of its other children, are left above the code's frame.
    interruptible, request_left, children_seen = job["return_value"]
    assert interruptible and not request_left
    assert children_seen and all(children == {} for children in children_seen)
