"""Starting and killing one sandbox: bubblewrap, a seccomp filter, an unprivileged uid.

The sandbox gets its own user, PID, network, mount, IPC and UTS namespaces; ``/usr`` read-only;
a fresh ``/proc``, ``/dev`` and size-capped tmpfs scratch; an empty environment; and a seccomp
filter that refuses every socket but ``AF_UNIX``. Its only way out is the bridge socket it inherits.
Killing the bwrap process tears down the PID namespace, and with it every descendant, including
ones that called ``setsid()``.
"""

import errno
import functools
import os
import socket
import subprocess
import tempfile
from pathlib import Path

from django.conf import settings

from execution.sandbox.limits import Limits

GUEST = Path(__file__).with_name("guest.py")
SANDBOX_UID = 65534  # nobody: used only when the worker runs as root
MOUNT_SDK = "/opt/ptc/sdk"
MOUNT_BIN = "/opt/ptc/bin"
SCRATCH_MB = 64


class SandboxUnavailable(Exception):
    """The sandbox cannot be started on this host (bwrap missing, user namespaces off, ...)."""


@functools.cache
def _seccomp_program() -> bytes:
    """Return the compiled BPF program: ``socket()`` of any family but AF_UNIX fails with EPERM.

    Also refused: ptrace, kernel keyrings, bpf, perf, userfaultfd and mounting, none of which
    job code needs and each of which has been a kernel escape route.
    """
    import pyseccomp as sc

    flt = sc.SyscallFilter(defaction=sc.ALLOW)
    flt.add_rule(sc.ERRNO(errno.EPERM), "socket", sc.Arg(0, sc.NE, socket.AF_UNIX))
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
def _guest_dir() -> Path:
    """Stage the runner where the sandbox's unprivileged uid can read it."""
    target = Path(settings.PTC_SANDBOX_DIR) / "bin"
    target.mkdir(parents=True, exist_ok=True, mode=0o755)
    os.chmod(settings.PTC_SANDBOX_DIR, 0o755)
    staged = target / "guest.py"
    content = GUEST.read_bytes()
    if not staged.exists() or staged.read_bytes() != content:
        tmp = target / f".guest-{os.getpid()}.py"
        tmp.write_bytes(content)
        os.chmod(tmp, 0o644)
        tmp.rename(staged)
    return target


def check() -> None:
    """Raise SandboxUnavailable, saying what to install, if a sandbox cannot start here."""
    for path, package in ((settings.PTC_BWRAP, "bubblewrap"), (settings.PTC_SANDBOX_PYTHON, "python3")):
        if not os.access(path, os.X_OK):
            raise SandboxUnavailable(f"{path} is missing: install Debian's '{package}' package.")
    try:
        _seccomp_program()
    except (ImportError, OSError, RuntimeError) as exc:
        raise SandboxUnavailable(f"cannot build the seccomp filter ({exc}): install 'libseccomp2' and pyseccomp.") from exc


def command(*, limits: Limits, sdk_dir: Path, bridge_fd: int, seccomp_fd: int) -> list[str]:
    python = settings.PTC_SANDBOX_PYTHON
    argv = [
        settings.PTC_BWRAP,
        "--unshare-all",
        "--die-with-parent",
        "--new-session",  # no TIOCSTI into the worker's terminal (CVE-2017-5226)
        "--cap-drop",
        "ALL",
        "--clearenv",
        "--setenv",
        "PATH",
        "/usr/bin:/bin",
        "--setenv",
        "HOME",
        "/work",
        "--setenv",
        "LANG",
        "C.UTF-8",
        "--setenv",
        "PYTHONIOENCODING",
        "utf-8",
        # Each thread's malloc arena reserves 64 MiB of address space; under RLIMIT_AS a thread
        # pool of tool calls would run out of memory it never used.
        "--setenv",
        "MALLOC_ARENA_MAX",
        "2",
        "--ro-bind",
        "/usr",
        "/usr",
        "--symlink",
        "usr/bin",
        "/bin",
        "--symlink",
        "usr/lib",
        "/lib",
        "--symlink",
        "usr/lib64",
        "/lib64",
        "--ro-bind-try",
        "/etc/localtime",
        "/etc/localtime",
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--size",
        str(SCRATCH_MB << 20),
        "--tmpfs",
        "/tmp",
        "--size",
        str(SCRATCH_MB << 20),
        "--tmpfs",
        "/work",
        "--ro-bind",
        str(sdk_dir),
        MOUNT_SDK,
        "--ro-bind",
        str(_guest_dir()),
        MOUNT_BIN,
        "--chdir",
        "/work",
        "--seccomp",
        str(seccomp_fd),
        "--",
        python,
        "-I",
        "-S",
        "-B",
        f"{MOUNT_BIN}/guest.py",
        str(bridge_fd),
        MOUNT_SDK,
    ]
    return argv


def spawn(*, limits: Limits, sdk_dir: Path, bridge_fd: int) -> subprocess.Popen[bytes]:
    """Start the sandbox. The caller owns the returned process and must ``kill`` and ``wait`` it."""
    seccomp_fd = _program_fd()
    try:
        as_root = os.geteuid() == 0
        return subprocess.Popen(
            command(limits=limits, sdk_dir=sdk_dir, bridge_fd=bridge_fd, seccomp_fd=seccomp_fd),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=(bridge_fd, seccomp_fd),
            env={},
            cwd="/",
            # setuid happens in C between fork and exec: safe from a threaded worker, unlike preexec_fn.
            user=SANDBOX_UID if as_root else None,
            group=SANDBOX_UID if as_root else None,
            extra_groups=[] if as_root else None,
            start_new_session=True,
        )
    finally:
        os.close(seccomp_fd)
