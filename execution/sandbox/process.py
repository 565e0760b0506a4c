"""Starting and killing sandboxes: a fork server in bubblewrap, a seccomp filter, an unprivileged uid.

Each exec worker runs one fork server (``zygote.py``) in a bubblewrap of its own: no network,
``/usr`` read-only, an empty environment, the sandbox's uid. It has imported the runner once, and
forks every sandbox from itself (a few milliseconds where a bubblewrap and an interpreter of
its own cost tens). Each sandbox gets its own user, PID, network, mount, IPC, UTS and cgroup
namespaces; a fresh ``/proc``; size-capped tmpfs scratch; no capabilities; and a seccomp filter
that refuses every socket but ``AF_UNIX``. Its only way out is the bridge socket it is given.
Killing it (``SandboxProcess.kill``) kills its PID 1, and with it every descendant, including
ones that called ``setsid()``. The fork server, and every sandbox with it, ends with its worker.
"""

import contextlib
import errno
import functools
import hashlib
import itertools
import json
import logging
import os
import select
import selectors
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from django.conf import settings

from tools.sdk import sdk_base_files

logger = logging.getLogger("ptc.sandbox")
GUEST = Path(__file__).with_name("guest.py")
ZYGOTE = Path(__file__).with_name("zygote.py")
SANDBOX_UID = 65534  # nobody: used only when the worker runs as root
SETPRIV = "/usr/bin/setpriv"  # util-linux's: drops root for bubblewrap (spawn)
MOUNT_SDK = "/opt/ptc/sdk"
MOUNT_BIN = "/opt/ptc/bin"
SCRATCH_MB = 64
SDK_MB = 16  # the job's generated SDK is written here: host memory, like every tmpfs
SHM_MB = 16
STAGED = ".staged"  # in a staged runner's folder once all of it is there
# A spawn is a few milliseconds; a fork server that has not answered by then is wedged.
SPAWN_TIMEOUT = 10.0
FORK_SERVER_GONE = "the fork server exited"
# A sandbox whose exit the fork server has not reported this long after it ended is taken as killed.
REPORT_GRACE = 2.0


class SandboxUnavailable(Exception):
    """The sandbox cannot be started on this host (bwrap missing, user namespaces off, ...)."""


# clone() flags that would make a new namespace: with a user namespace the code would get a full
# set of capabilities inside it, and with them the kernel's netfilter and mount code to attack.
_CLONE_NAMESPACE_FLAGS = (
    0x10000000,  # CLONE_NEWUSER
    0x40000000,  # CLONE_NEWNET
    0x00020000,  # CLONE_NEWNS
    0x20000000,  # CLONE_NEWPID
    0x08000000,  # CLONE_NEWIPC
    0x04000000,  # CLONE_NEWUTS
    0x02000000,  # CLONE_NEWCGROUP
)


# What the fork server needs and each sandbox it forks gives up: a user namespace of its own and
# the mounts in it (zygote.py). The fork server runs no job's code.
_FORK_SERVER_NEEDS = ("unshare", "mount", "umount2")


@functools.cache
def _seccomp_program(*, fork_server: bool = False) -> bytes:
    """Return the compiled BPF program: ``socket()`` of any family but AF_UNIX fails with EPERM.

    Also refused: io_uring (its IORING_OP_SOCKET makes sockets without ``socket()``), clone() into
    new namespaces, clone3 (its flags sit in memory a filter can't read: ENOSYS makes libc fall
    back to clone), and ptrace, kernel keyrings, bpf, perf, userfaultfd and mounting, none of
    which job code needs and each of which has been a kernel escape route.
    """
    import pyseccomp as sc

    flt = sc.SyscallFilter(defaction=sc.ALLOW)
    flt.add_rule(sc.ERRNO(errno.EPERM), "socket", sc.Arg(0, sc.NE, socket.AF_UNIX))
    for flag in _CLONE_NAMESPACE_FLAGS:
        flt.add_rule(sc.ERRNO(errno.EPERM), "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    flt.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    for name in ("io_uring_setup", "io_uring_enter", "io_uring_register"):
        flt.add_rule(sc.ERRNO(errno.EPERM), name)
    for name in (
        "ptrace",
        "keyctl",
        "add_key",
        "request_key",
        "bpf",
        "perf_event_open",
        "userfaultfd",
        "mount",
        "umount2",
        "pivot_root",
        "swapon",
        "swapoff",
        "reboot",
        "kexec_load",
        "init_module",
        "finit_module",
        "delete_module",
        "unshare",
        "setns",
    ):
        if not (fork_server and name in _FORK_SERVER_NEEDS):
            flt.add_rule(sc.ERRNO(errno.EPERM), name)
    with tempfile.TemporaryFile() as handle:
        flt.export_bpf(handle)
        handle.seek(0)
        return handle.read()


def _program_fd(*, fork_server: bool = False) -> int:
    """Return a fresh fd holding a seccomp program at offset 0: the fork server's, for bwrap's
    ``--seccomp``, or the sandboxes', for the fork server to load into each."""
    fd = os.memfd_create("ptc-seccomp", os.MFD_CLOEXEC)
    os.write(fd, _seccomp_program(fork_server=fork_server))
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


@functools.cache
def _guest_files() -> tuple[str, dict[str, bytes]]:
    """The runner and the SDK's base package, and the content hash they are staged under."""
    files = {path.name: path.read_bytes() for path in (GUEST, ZYGOTE)}
    files.update((name, text.encode()) for name, text in sdk_base_files().items())
    digest = hashlib.sha256(b"".join(name.encode() + content for name, content in sorted(files.items())))
    return digest.hexdigest()[:16], files


_staging = threading.Lock()


def _guest_dir() -> Path:
    """Stage the runner and the SDK's base package (imported before a job comes) where the
    sandbox's unprivileged uid can read them, under their content hash, compiled, and return where.

    By hash, so workers of different versions sharing a host never run each other's runner.
    Checked on every start (one stat): a stage removed under the worker (a /tmp cleaner) is staged
    again, rather than failing every sandbox until a restart.
    """
    digest, files = _guest_files()
    root = Path(settings.PTC_SANDBOX_DIR)
    target = root / "bin" / digest
    if (target / STAGED).exists():
        return target
    with _staging:  # the pool's thread and job threads may all find it missing at once
        if (target / STAGED).exists():
            return target
        target.mkdir(parents=True, exist_ok=True, mode=0o755)
        for directory in (root, root / "bin", target):
            os.chmod(directory, 0o755)
        for name, content in files.items():
            path = target / name
            path.parent.mkdir(exist_ok=True, mode=0o755)
            _write_whole(path, content)
        _compile(target, names=list(files))
        _write_whole(target / STAGED, b"")  # last: the stage is whole
    return target


def _write_whole(path: Path, content: bytes) -> None:
    """Write ``path``, readable by all, so that no one ever reads half of it."""
    # A name of its own: another worker process on this host may be staging the same files.
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    with os.fdopen(fd, "wb") as handle:
        handle.write(content)
    os.chmod(tmp, 0o644)
    os.rename(tmp, path)  # atomic


def _compile(target: Path, *, names: list[str]) -> None:
    """Compile the staged modules to bytecode with the sandbox's own interpreter. A sandbox can
    write nothing there (and runs with -B), so it would otherwise compile them from source at every
    start: a third of its start's CPU. Without bytecode it still starts, only slower."""
    argv = [settings.PTC_SANDBOX_PYTHON, "-I", "-m", "compileall", "-q", str(target)]
    compiled = subprocess.run(argv, capture_output=True, text=True, check=False)
    if compiled.returncode != 0:
        logger.warning("could not compile the sandbox's runner; it starts from source: %s", compiled.stdout + compiled.stderr)
    # Readable by the sandbox's uid whatever the worker's umask. Only the bytecode folders and files
    # (not another stager's temporary files, which it renames meanwhile), and never through a link.
    for folder in {(target / name).parent / "__pycache__" for name in names}:
        for path in [folder, *folder.glob("*.pyc")]:
            try:
                if not path.is_symlink():
                    os.chmod(path, 0o755 if path is folder else 0o644)
            except FileNotFoundError:
                pass


@functools.cache
def check() -> None:
    """Raise SandboxUnavailable, saying what to install, if a sandbox cannot start here. Once a
    process found everything, it doesn't look again."""
    needed = [(settings.PTC_BWRAP, "bubblewrap"), (settings.PTC_SANDBOX_PYTHON, "python3")]
    if os.geteuid() == 0:
        needed.append((SETPRIV, "util-linux"))
    for path, package in needed:
        if not os.access(path, os.X_OK):
            raise SandboxUnavailable(f"{path} is missing: install Debian's '{package}' package.")
    try:
        _seccomp_program()
    except (ImportError, OSError, RuntimeError) as exc:
        raise SandboxUnavailable(f"cannot build the seccomp filter ({exc}): install 'libseccomp2' and pyseccomp.") from exc


def trial() -> None:
    """Start one sandbox and let it go unused; raise SandboxUnavailable, with what it said, if it
    could not set itself up (a host that refuses a user namespace inside bubblewrap's, say)."""
    ours, theirs = socket.socketpair()
    try:
        sandbox = spawn(bridge_fd=theirs.fileno())
    finally:
        theirs.close()
    ours.close()  # its runner reads the bridge's end before any job, and exits 0
    try:
        status = sandbox.wait(SPAWN_TIMEOUT)
    except subprocess.TimeoutExpired:
        sandbox.kill()
        status = sandbox.wait()
    said = sandbox.stderr.read().decode(errors="replace").strip()
    _close(sandbox)
    if status != 0:
        raise SandboxUnavailable(f"a sandbox could not start (status {status}): {said or 'it said nothing'}")


def command(*, control_fd: int, seccomp_fd: int, program_fd: int) -> list[str]:
    """Return the bwrap command line of the fork server (zygote.py), with its control socket on
    ``control_fd``, its own seccomp filter on ``seccomp_fd`` and its sandboxes' on ``program_fd``.
    Nothing in it is a job's: a job, its limits and its SDK come as its sandbox's first frame."""
    options: list[tuple[str, ...]] = [
        ("--unshare-all",),
        ("--unshare-user",),
        ("--hostname", "sandbox"),
        ("--die-with-parent",),
        ("--new-session",),  # no TIOCSTI into the worker's terminal (CVE-2017-5226)
        ("--cap-drop", "ALL"),
        ("--clearenv",),
        ("--setenv", "PATH", "/usr/bin:/bin"),
        ("--setenv", "HOME", "/work"),
        ("--setenv", "LANG", "C.UTF-8"),
        ("--setenv", "PYTHONIOENCODING", "utf-8"),
        # Each thread's malloc arena reserves 64 MiB of address space; under RLIMIT_AS a thread
        # pool of tool calls would run out of memory it never used.
        ("--setenv", "MALLOC_ARENA_MAX", "2"),
        ("--ro-bind", "/usr", "/usr"),
        ("--symlink", "usr/bin", "/bin"),
        ("--symlink", "usr/lib", "/lib"),
        ("--symlink", "usr/lib64", "/lib64"),
        ("--ro-bind-try", "/etc/localtime", "/etc/localtime"),
        # Bare: the kernel lets a sandbox's user namespace mount a /proc of its own only where one
        # is fully visible, so its covers (PROC_COVERED) are put on each sandbox's (zygote.py).
        ("--proc", "/proc"),
        ("--dev", "/dev"),
        # Where each sandbox mounts its own tmpfs. The fork server writes nothing.
        *(("--size", str(1 << 20), "--tmpfs", target) for target in _scratch()),
        ("--ro-bind", str(_guest_dir()), MOUNT_BIN),
        *(("--remount-ro", target) for target in _scratch()),
        ("--remount-ro", "/dev"),
        ("--remount-ro", "/"),  # bwrap's root is an unsized tmpfs: read-only, so nothing can fill it
        ("--chdir", "/"),
        ("--seccomp", str(seccomp_fd)),
    ]
    # -u: what the code prints reaches the worker as it is printed, with or without a newline or flush.
    # The runner is imported, not run as a script, so that it loads from its staged bytecode.
    launch = f"import sys; sys.path.insert(0, {MOUNT_BIN!r}); import zygote; zygote.main()"
    args = (str(control_fd), str(program_fd), MOUNT_SDK, json.dumps(_scratch()))
    guest = (settings.PTC_SANDBOX_PYTHON, "-I", "-S", "-B", "-u", "-c", launch, *args)
    return [settings.PTC_BWRAP, *itertools.chain.from_iterable(options), "--", *guest]


def _scratch() -> dict[str, int]:
    """Each sandbox's writable places, and their sizes in bytes: every one is a size-capped tmpfs
    (tmpfs pages are host memory)."""
    return {"/dev/shm": SHM_MB << 20, "/tmp": SCRATCH_MB << 20, "/work": SCRATCH_MB << 20, MOUNT_SDK: SDK_MB << 20}


def scratch_bytes() -> int:
    """What a sandbox's scratch filesystems may hold together, in bytes: memory its job may use."""
    return sum(_scratch().values())


class SandboxProcess:
    """One sandbox the fork server forked, as the worker holds it: like a ``Popen``. Its stdout and
    stderr are pipes, its ``pid`` is the sandbox's outermost process (on this host), killing that
    kills everything in the sandbox, and its exit status comes from the fork server."""

    def __init__(self, stdout: int, stderr: int) -> None:
        self.stdout = open(stdout, "rb")
        self.stderr = open(stderr, "rb")
        self.pid: int | None = None
        self.returncode: int | None = None
        self._pidfd: int | None = None
        self._lock = threading.Lock()  # the pidfd is closed at the exit, never while a signal uses it
        self._started = threading.Event()
        self._exited = threading.Event()
        self._error = ""

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the fork server's report of its exit. One that has not come ``REPORT_GRACE``
        after the sandbox's outermost process ended (a wedged fork server) is not waited for."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._exited.wait(REPORT_GRACE if deadline is None else min(REPORT_GRACE, deadline - time.monotonic())):
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired("sandbox", timeout or 0)
            with self._lock:
                ended = self._pidfd is not None and bool(select.select([self._pidfd], [], [], 0)[0])
            if ended and not self._exited.wait(REPORT_GRACE):
                logger.error("the fork server did not report a sandbox's exit: taken as killed")
                self._exit(-signal.SIGKILL)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, signum: int) -> None:
        with self._lock:
            if self.returncode is None and self._pidfd is not None:
                try:
                    signal.pidfd_send_signal(self._pidfd, signum)
                except ProcessLookupError:  # it exited; the fork server reports it
                    pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _start(self, pidfd: int) -> None:
        with self._lock:
            if self.returncode is not None:  # its spawn was given up on: it must not run
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                os.close(pidfd)
                return
            self._pidfd = pidfd
            self.pid = _pid_of(pidfd)
        self._started.set()

    def _fail(self, error: str) -> None:
        """The fork server did not start it, and says why."""
        with self._lock:
            if self.returncode is None:
                self._error = error
        self._exit(-signal.SIGKILL)

    def _exit(self, returncode: int) -> None:
        with self._lock:
            if self.returncode is not None:
                return
            self.returncode = returncode
            if self._pidfd is not None:
                os.close(self._pidfd)
                self._pidfd = None
        self._started.set()
        self._exited.set()


def _pid_of(pidfd: int) -> int | None:
    """The pid, in this process's PID namespace, of the process ``pidfd`` refers to."""
    with open(f"/proc/self/fdinfo/{pidfd}") as info:
        for line in info:
            if line.startswith("Pid:"):
                pid = int(line.split()[1])
                return pid if pid > 0 else None  # -1: it has been reaped
    return None


class ForkServer:
    """This process's fork server: one bubblewrap running zygote.py, started when first needed and
    again after it died. Its thread starts it (bubblewrap's ``--die-with-parent`` is tied to the
    thread that forked it: SANDBOX-NOTES.md) and reads its reports and its stderr."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._thread: threading.Thread | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._control: socket.socket | None = None  # set while a fork server runs
        self._failure: str | None = None  # why the last start failed
        self._wanted = False
        self._sandboxes: dict[int, SandboxProcess] = {}  # by request id, until their exit
        self._ids = itertools.count(1)

    def spawn(self, bridge_fd: int) -> SandboxProcess:
        """Fork a sandbox that waits for its job on ``bridge_fd``. The caller owns it and must
        ``kill`` and ``wait`` it. Raise SandboxUnavailable when the fork server can't run here.

        A fork server that dies under a spawn is started again, once, for it."""
        for attempt in (1, 2):
            sandbox = self._spawn(bridge_fd)
            if not sandbox._error:
                return sandbox
            _close(sandbox)
            if sandbox._error != FORK_SERVER_GONE or attempt == 2:
                raise SandboxUnavailable(f"the fork server could not start a sandbox: {sandbox._error}")
        raise AssertionError("unreachable")

    def _spawn(self, bridge_fd: int) -> SandboxProcess:
        control = self._running()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        sandbox = SandboxProcess(out_r, err_r)
        request_id = next(self._ids)
        with self._lock:
            self._sandboxes[request_id] = sandbox
        try:
            request = json.dumps({"op": "spawn", "id": request_id}).encode()
            # Never blocks: a fork server that let its socket fill up is wedged.
            socket.send_fds(control, [request], [bridge_fd, out_w, err_w], socket.MSG_DONTWAIT)
        except BlockingIOError:
            sandbox._fail("the fork server is not reading its requests")
            self._replace(sandbox._error)
        except OSError:
            sandbox._fail(FORK_SERVER_GONE)  # its thread says why
            self._forgotten(control)  # so that the spawn's second attempt starts another
        finally:
            os.close(out_w)
            os.close(err_w)
        if not sandbox._started.wait(SPAWN_TIMEOUT):
            sandbox._fail(f"the fork server did not answer within {SPAWN_TIMEOUT} s")
            self._replace(sandbox._error)
        return sandbox

    def _forgotten(self, control: socket.socket) -> None:
        """Wait (up to SPAWN_TIMEOUT) until the thread has ended the dead fork server behind
        ``control``: until then ``_running`` would hand it out again."""
        deadline = time.monotonic() + SPAWN_TIMEOUT
        with self._lock:
            while self._control is control and time.monotonic() < deadline:
                self._lock.wait(deadline - time.monotonic())

    def _replace(self, why: str) -> None:
        """Kill a wedged fork server (its sandboxes with it): the next spawn starts another."""
        with self._lock:
            proc = self._proc if self._control is not None else None
        if proc is not None:
            logger.error("killing the sandboxes' fork server: %s", why)
            proc.kill()

    def _running(self) -> socket.socket:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._serve, name="ptc-fork-server", daemon=True)
                self._thread.start()
            if self._control is None:
                self._wanted, self._failure = True, None
                self._lock.notify_all()
                deadline = time.monotonic() + SPAWN_TIMEOUT
                while self._control is None and self._failure is None and time.monotonic() < deadline:
                    self._lock.wait(deadline - time.monotonic())
                if self._control is None:
                    why = self._failure or f"not started within {SPAWN_TIMEOUT} s"
                    raise SandboxUnavailable(f"the sandboxes' fork server could not start: {why}")
            return self._control

    def _serve(self) -> None:
        while True:
            with self._lock:
                while not self._wanted:
                    self._lock.wait()
            try:
                proc, control = self._start()
            except Exception as exc:  # said to every caller waiting for it
                with self._lock:
                    self._failure, self._wanted = str(exc) or type(exc).__name__, False
                    self._lock.notify_all()
                continue
            with self._lock:
                self._proc, self._control, self._wanted = proc, control, False
                self._lock.notify_all()
            try:
                self._read(proc, control)
            except Exception:  # the thread must live on: every later spawn depends on it
                logger.exception("the sandboxes' fork server's reports could not be read")
            finally:
                self._ended(proc, control)

    def _ended(self, proc: subprocess.Popen[bytes], control: socket.socket) -> None:
        with self._lock:
            self._control = None
            orphans, self._sandboxes = list(self._sandboxes.values()), {}
            self._lock.notify_all()  # a spawn that found it dead waits for this (_forgotten)
        control.close()
        # Its PID namespace is gone, and every sandbox in it.
        for sandbox in orphans:
            if sandbox._started.is_set():
                sandbox._exit(-signal.SIGKILL)
            else:
                sandbox._fail(FORK_SERVER_GONE)
        proc.kill()
        proc.wait()
        assert proc.stderr is not None
        said = proc.stderr.read().decode(errors="replace").strip()
        proc.stderr.close()
        logger.error("the sandboxes' fork server exited (status %s): %s", proc.returncode, said or "no message")

    def _start(self) -> tuple[subprocess.Popen[bytes], socket.socket]:
        check()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        seccomp_fd = _program_fd(fork_server=True)
        program_fd = _program_fd()
        try:
            argv = command(control_fd=theirs.fileno(), seccomp_fd=seccomp_fd, program_fd=program_fd)
            if os.geteuid() == 0:
                # A worker running as root starts bubblewrap as nobody, through setpriv rather than
                # Popen's user=: with it, Python forks (copying the worker's page tables, milliseconds
                # of CPU with every thread stopped); without it, Python uses vfork.
                uid = str(SANDBOX_UID)
                argv = [SETPRIV, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *argv]
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                pass_fds=(theirs.fileno(), seccomp_fd, program_fd),
                env={},
                cwd="/",
                start_new_session=True,
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
            os.close(seccomp_fd)
            os.close(program_fd)
        return proc, ours

    def _read(self, proc: subprocess.Popen[bytes], control: socket.socket) -> None:
        """Hand each report of the fork server to its sandbox, and log what it says on stderr
        (read as it comes: a full pipe would stop it), until it ends."""
        assert proc.stderr is not None
        with selectors.DefaultSelector() as sel:
            sel.register(control, selectors.EVENT_READ, "control")
            sel.register(proc.stderr, selectors.EVENT_READ, "stderr")
            while True:
                for key, _ in sel.select():
                    if key.data == "stderr":
                        said = os.read(proc.stderr.fileno(), 1 << 16)
                        if not said:
                            return
                        logger.warning("the sandboxes' fork server: %s", said.decode(errors="replace").strip())
                        continue
                    try:
                        data, fds, _, _ = socket.recv_fds(control, 4096, 1)
                    except OSError:
                        return
                    if not data:
                        return
                    self._report(json.loads(data), fds)

    def _report(self, report: dict[str, Any], fds: list[int]) -> None:
        with self._lock:
            sandbox = self._sandboxes.get(report.get("id"))  # type: ignore[arg-type]
            if sandbox is not None and report["op"] in ("exit", "failed"):
                del self._sandboxes[report["id"]]
        if sandbox is None:  # a spawn its caller gave up on
            for fd in fds:
                os.close(fd)
            return
        if report["op"] == "started" and fds:
            sandbox._start(fds[0])
        elif report["op"] == "started":
            sandbox._fail("the fork server's report came without the sandbox's pidfd")
        elif report["op"] == "exit":
            sandbox._exit(report["status"])
        else:
            sandbox._fail(str(report.get("error")))


def _close(sandbox: SandboxProcess) -> None:
    for pipe in (sandbox.stdout, sandbox.stderr):
        pipe.close()


_fork_server = ForkServer()


def spawn(*, bridge_fd: int) -> SandboxProcess:
    """Start a sandbox that waits for its job on ``bridge_fd``. The caller owns the returned
    process and must ``kill`` and ``wait`` it.

    Raise SandboxUnavailable, saying what to install, when this host can't run one.
    """
    check()
    return _fork_server.spawn(bridge_fd)
