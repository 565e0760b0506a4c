"""Starting and killing one sandbox: bubblewrap, a seccomp filter, an unprivileged uid.

The sandbox gets its own user, PID, network, mount, IPC and UTS namespaces; ``/usr`` read-only;
a fresh ``/proc``, ``/dev`` and size-capped tmpfs scratch; an empty environment; and a seccomp
filter that refuses every socket but ``AF_UNIX``. Its only way out is the bridge socket it inherits.
Killing the bwrap process tears down the PID namespace, and with it every descendant, including
ones that called ``setsid()``.
"""

import errno
import functools
import hashlib
import itertools
import logging
import os
import socket
import subprocess
import tempfile
import threading
from pathlib import Path

from django.conf import settings

from tools.sdk import sdk_base_files

logger = logging.getLogger("ptc.sandbox")
GUEST = Path(__file__).with_name("guest.py")
SANDBOX_UID = 65534  # nobody: used only when the worker runs as root
SETPRIV = "/usr/bin/setpriv"  # util-linux's: drops root for bubblewrap (spawn)
MOUNT_SDK = "/opt/ptc/sdk"
MOUNT_BIN = "/opt/ptc/bin"
SCRATCH_MB = 64
SDK_MB = 16  # the job's generated SDK is written here: host memory, like every tmpfs
SHM_MB = 16
STAGED = ".staged"  # in a staged runner's folder once all of it is there


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


@functools.cache
def _seccomp_program() -> bytes:
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
        flt.add_rule(sc.ERRNO(errno.EPERM), name)
    with tempfile.TemporaryFile() as handle:
        flt.export_bpf(handle)
        handle.seek(0)
        return handle.read()


def _program_fd() -> int:
    """Return a fresh fd holding the seccomp program at offset 0, for bwrap's ``--seccomp``."""
    fd = os.memfd_create("ptc-seccomp", 0)
    os.write(fd, _seccomp_program())
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


@functools.cache
def _guest_files() -> tuple[str, dict[str, bytes]]:
    """The runner and the SDK's base package, and the content hash they are staged under."""
    files = {"guest.py": GUEST.read_bytes(), **{name: text.encode() for name, text in sdk_base_files().items()}}
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


def command(*, bridge_fd: int, seccomp_fd: int) -> list[str]:
    """Return the bwrap command line that runs the guest with the bridge on ``bridge_fd``. Nothing
    in it is a job's: the job, its limits and its SDK come as the bridge's first frame."""
    options: list[tuple[str, ...]] = [
        ("--unshare-all",),
        ("--unshare-user",),
        ("--disable-userns",),  # no nested user namespace, so no capabilities to be had inside
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
        ("--proc", "/proc"),
        ("--ro-bind", "/dev/null", "/proc/cmdline"),  # the host's boot arguments are none of its business
        ("--dev", "/dev"),
        # Every writable place is a size-capped tmpfs: tmpfs pages are host memory.
        ("--size", str(SHM_MB << 20), "--tmpfs", "/dev/shm"),
        ("--size", str(SCRATCH_MB << 20), "--tmpfs", "/tmp"),
        ("--size", str(SCRATCH_MB << 20), "--tmpfs", "/work"),
        ("--size", str(SDK_MB << 20), "--tmpfs", MOUNT_SDK),
        ("--ro-bind", str(_guest_dir()), MOUNT_BIN),
        ("--remount-ro", "/dev"),
        ("--remount-ro", "/"),  # bwrap's root is an unsized tmpfs: read-only, so nothing can fill it
        ("--chdir", "/work"),
        ("--seccomp", str(seccomp_fd)),
    ]
    # -u: what the code prints reaches the worker as it is printed, with or without a newline or flush.
    # The runner is imported, not run as a script, so that it loads from its staged bytecode.
    launch = f"import sys; sys.path.insert(0, {MOUNT_BIN!r}); import guest; guest.main()"
    guest = (settings.PTC_SANDBOX_PYTHON, "-I", "-S", "-B", "-u", "-c", launch, str(bridge_fd), MOUNT_SDK)
    return [settings.PTC_BWRAP, *itertools.chain.from_iterable(options), "--", *guest]


def spawn(*, bridge_fd: int) -> subprocess.Popen[bytes]:
    """Start a sandbox that waits for its job on ``bridge_fd``. The caller owns the returned
    process and must ``kill`` and ``wait`` it.

    Raise SandboxUnavailable, saying what to install, when this host can't run one.
    """
    check()
    seccomp_fd = _program_fd()
    try:
        argv = command(bridge_fd=bridge_fd, seccomp_fd=seccomp_fd)  # stages the runner if it must
        if os.geteuid() == 0:
            # A worker running as root starts bubblewrap as nobody, through setpriv rather than
            # Popen's user=: with it, Python forks (copying the worker's page tables, milliseconds of
            # CPU with every thread stopped); without it, Python uses vfork.
            uid = str(SANDBOX_UID)
            argv = [SETPRIV, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *argv]
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=(bridge_fd, seccomp_fd),
            env={},
            cwd="/",
            start_new_session=True,
        )
    finally:
        os.close(seccomp_fd)
