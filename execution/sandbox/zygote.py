"""The sandboxes' fork server. Runs under the sandbox's own interpreter, standard library only.

    python3 -I -S -B -c "...; import zygote; zygote.main()" CONTROL_FD SECCOMP_FD SDK_DIR LIMITS

One bubblewrap holds it (as the sandbox's uid, no network, ``/usr`` read-only). It imports the
runner and the SDK's base package once, and then forks each sandbox from itself: a ready
interpreter in a few milliseconds of CPU, where a start of its own (bubblewrap, an interpreter,
the imports) costs tens. A sandbox is still single-use and shares nothing with its siblings but
what the fork server held before any job: the imported, never-run code.

Each sandbox, forked on a ``spawn`` request that brings its bridge, stdout and stderr:

    fork server ── C (its own user, mount, PID, network, IPC, UTS and cgroup namespaces;
                  │   tmpfs /work, /tmp, /dev/shm and SDK dir; waits, exits as I did)
                  └── I (PID 1 of the sandbox: a fresh /proc; reaps orphans; exits as G did)
                       └── G (no capabilities, no new privileges, the full seccomp filter:
                              the runner, waiting for its job on the bridge)

Its own user namespace gives each sandbox its own count of processes (``RLIMIT_NPROC`` counts per
namespace and uid), so one job's fork bomb does not stop another's ``fork()``. Killing C (the
worker holds a pidfd of it) kills I (``PR_SET_PDEATHSIG``), and with PID 1 the kernel kills
everything in the sandbox. The fork server reports each C's exit status on the control socket.
It ends when the worker closes that socket, and with it, bubblewrap's PID namespace and every
sandbox.
"""

import ctypes
import fcntl
import gc
import json
import os
import resource
import select
import signal
import socket
import sys
from typing import NoReturn

CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 0x20, 0x1000, 0x4000, 0x40000
MNT_DETACH = 0x2
PR_SET_PDEATHSIG, PR_SET_NAME, PR_SET_SECCOMP, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 15, 22, 24, 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL, SECCOMP_MODE_FILTER = 4, 2
LINUX_CAPABILITY_VERSION_3 = 0x20080522
# bubblewrap covers these with read-only binds of themselves; each sandbox's own /proc gets the same.
PROC_COVERED = ("sys", "sysrq-trigger", "irq", "bus")
# The fds a sandbox's runner starts with: stdin is /dev/null.
STDOUT, STDERR, BRIDGE = 1, 2, 3
FD_MOVED_TO = 100
MAX_FD = 1 << 16
# C's exit status when it could not set a sandbox up: its stderr (the job's) says why.
SETUP_FAILED = 71

_libc = ctypes.CDLL(None, use_errno=True)


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    encode = lambda text: text.encode() if text is not None else None  # noqa: E731
    _check(_libc.mount(encode(source), encode(target), encode(fstype), ctypes.c_ulong(flags), encode(data)), f"mount {target}")


def _name(name: str) -> None:
    """Name this process (ps, pgrep): the fork server, a sandbox (C), its init, its runner."""
    _libc.prctl(PR_SET_NAME, name.encode(), 0, 0, 0)


def _write(path: str, text: str) -> None:
    try:
        fd = os.open(path, os.O_WRONLY)
        try:
            os.write(fd, text.encode())
        finally:
            os.close(fd)
    except OSError as exc:
        raise OSError(exc.errno, f"write {path}: {exc.strerror}") from None


def _drop_capabilities(last_cap: int) -> None:
    """No capabilities now, none in the bounding set to regain through exec, none ambient."""
    for cap in range(last_cap + 1):
        _check(_libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), "drop a capability")
    _check(_libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "clear ambient capabilities")
    header = _CapHeader(LINUX_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    _check(_libc.capset(ctypes.byref(header), ctypes.byref(data)), "capset")


class Server:
    def __init__(self, control: socket.socket, seccomp: bytes, sdk_dir: str, limits: dict[str, int]) -> None:
        self.control = control
        self.seccomp = ctypes.create_string_buffer(seccomp, len(seccomp))
        self.sdk_dir = sdk_dir
        self.limits = limits  # tmpfs sizes, in bytes, by mount point
        self.uid, self.gid = os.getuid(), os.getgid()
        with open("/proc/sys/kernel/cap_last_cap") as f:
            self.last_cap = int(f.read())
        self.children: dict[int, tuple[int, int]] = {}  # pidfd -> (request id, pid)
        self.poll = select.poll()  # the control socket, and a pidfd per child: readable at its exit

    def serve(self) -> list[int]:
        """Serve spawn requests until the worker closes the control socket, then exit. Return only
        in a forked child: its bridge, stdout and stderr, with nothing of the serving left on its
        stack (a sandbox's code can read every frame above its own)."""
        self.poll.register(self.control, select.POLLIN)
        while True:
            for fd, _ in self.poll.poll():
                if fd != self.control.fileno():
                    self._reap(fd)
                    continue
                try:
                    data, fds, _, _ = socket.recv_fds(self.control, 4096, 3)
                except ConnectionError:
                    data, fds = b"", []
                if not data:
                    os._exit(0)  # the worker closed the socket (it exits): every sandbox goes with this process
                if self._spawn(json.loads(data), fds):
                    return fds

    def _spawn(self, request: dict, fds: list[int]) -> bool:
        """Fork a sandbox for ``request``; return True in the child. One failed spawn (the fds in
        flight of this uid at their limit, a fork refused) is reported, and the serving goes on."""
        pid = 0
        try:
            if request.get("op") != "spawn" or len(fds) != 3:
                raise ValueError("a spawn request brings three fds")
            pid = os.fork()
            if pid == 0:
                return True
            pidfd = os.pidfd_open(pid)
            try:
                self._send({"op": "started", "id": request["id"]}, fds=[pidfd])
            except BaseException:
                os.close(pidfd)
                raise
            self.children[pidfd] = (request["id"], pid)
            self.poll.register(pidfd, select.POLLIN)
        except Exception as exc:
            if pid:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            self._report({"op": "failed", "id": request.get("id"), "error": f"{type(exc).__name__}: {exc}"})
        finally:
            if pid != 0:
                for fd in fds:
                    os.close(fd)
        return False

    def _reap(self, pidfd: int) -> None:
        request_id, pid = self.children.pop(pidfd)
        self.poll.unregister(pidfd)
        os.close(pidfd)
        _, status = os.waitpid(pid, 0)
        self._report({"op": "exit", "id": request_id, "status": os.waitstatus_to_exitcode(status)})

    def _send(self, message: dict, fds: list[int] = ()) -> None:  # type: ignore[assignment]
        socket.send_fds(self.control, [json.dumps(message).encode()], list(fds))

    def _report(self, message: dict) -> None:
        """Send a report that carries no fd, and so can't be refused for the fds in flight."""
        try:
            self._send(message)
        except OSError as exc:  # the worker is gone: the next read of the socket ends this process
            os.write(2, f"ptc: a report was lost: {exc}\n".encode())

    # -- in the forked child ------------------------------------------------------------------
    def sandbox(self, fds: list[int]) -> NoReturn:
        """C: make the sandbox's namespaces and scratch, fork its PID 1, exit as it does."""
        try:
            _name("ptc-sandbox")
            # Nothing of the fork server's other children for the code to find in this object.
            self.children.clear()
            del self.poll
            # Python's KeyboardInterrupt handler would let the code interrupt its PID 1; the
            # runner gets it back.
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.setsid()
            # Out of the way of the numbers they go to first: they may hold any of them.
            high = [fcntl.fcntl(fd, fcntl.F_DUPFD, FD_MOVED_TO) for fd in fds]
            for fd, number in zip(high, (BRIDGE, STDOUT, STDERR), strict=True):
                os.dup2(fd, number)
            os.dup2(os.open("/dev/null", os.O_RDONLY), 0)
            # Nothing else of the fork server's: not its control socket, not its other children's pidfds.
            os.closerange(BRIDGE + 1, MAX_FD)
            flags = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWCGROUP
            _check(_libc.unshare(flags), "unshare")
            _write("/proc/self/setgroups", "deny")
            _write("/proc/self/uid_map", f"{self.uid} {self.uid} 1")
            _write("/proc/self/gid_map", f"{self.gid} {self.gid} 1")
            _mount(None, "/", None, MS_REC | MS_PRIVATE)
            for target, size in self.limits.items():
                _mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV, f"size={size},mode=0755")
            # Pseudo-terminals of its own: in the fork server's, a sibling could open its ptys.
            _mount("devpts", "/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=620")
            os.chdir("/")
            parent_gone_r, parent_gone_w = os.pipe()
            pid = os.fork()
        except BaseException as exc:
            self._fail(exc)
        if pid == 0:
            os.close(parent_gone_w)
            self._init(parent_gone_r)
        for fd in (0, BRIDGE, STDOUT, STDERR, parent_gone_r):
            os.close(fd)
        _, status = os.waitpid(pid, 0)
        os._exit(_exit_code(status))

    def _init(self, parent_gone: int) -> NoReturn:
        """I: PID 1 of the sandbox. Mounts its /proc, forks the runner, reaps what the code orphans."""
        try:
            _name("ptc-init")
            _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "PR_SET_PDEATHSIG")
            if select.select([parent_gone], [], [], 0)[0]:
                os._exit(SETUP_FAILED)  # C died before the line above: nobody would kill this sandbox
            os.close(parent_gone)
            _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
            for name in PROC_COVERED:
                path = f"/proc/{name}"
                if os.path.exists(path):
                    _mount(path, path, None, MS_BIND | MS_REC)
                    _mount(None, path, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)
            _mount("/dev/null", "/proc/cmdline", None, MS_BIND)  # the host's boot arguments are not the code's
            pid = os.fork()
        except BaseException as exc:
            self._fail(exc)
        if pid == 0:
            self._runner()
        for fd in (0, BRIDGE, STDOUT, STDERR):
            os.close(fd)
        while True:
            try:
                reaped, status = os.wait()
            except ChildProcessError:
                os._exit(SETUP_FAILED)
            if reaped == pid:
                os._exit(_exit_code(status))

    def _runner(self) -> NoReturn:
        """G: give up every privilege, then run the runner, which waits for its job on the bridge."""
        try:
            _name("ptc-runner")
            _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "PR_SET_PDEATHSIG")
            _drop_capabilities(self.last_cap)
            _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "PR_SET_NO_NEW_PRIVS")
            program = _SockFprog(len(self.seccomp) // 8, ctypes.cast(self.seccomp, ctypes.c_void_p))
            _check(_libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(program), 0, 0), "seccomp")
            signal.signal(signal.SIGINT, signal.default_int_handler)
            os.chdir("/work")
        except BaseException as exc:
            self._fail(exc)
        import guest

        guest.main(BRIDGE, self.sdk_dir)
        os._exit(0)

    def _fail(self, exc: BaseException) -> NoReturn:
        try:
            os.write(STDERR, f"ptc: could not set up the sandbox: {exc}\n".encode())
        finally:
            os._exit(SETUP_FAILED)


def _exit_code(status: int) -> int:
    """A process's status as an exit code a parent can pass on: 128 + N for signal N, as a shell's."""
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


def main() -> None:
    control_fd, seccomp_fd, sdk_dir, limits = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4])
    with os.fdopen(seccomp_fd, "rb") as f:
        seccomp = f.read()
    _name("ptc-fork-server")
    import guest

    guest.prepare()
    # What is imported now stays out of the collector's sight: a sandbox's collections would
    # otherwise touch, and so copy, every page of it that the fork shares.
    gc.freeze()
    # Each spawn sends a pidfd, which counts against the fds in flight of this uid, the sandboxes'
    # too: at their sum's soft limit, the kernel would refuse it.
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    server = Server(socket.socket(fileno=control_fd), seccomp, sdk_dir, limits)
    server.sandbox(server.serve())


if __name__ == "__main__":
    main()
