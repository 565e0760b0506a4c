"""A job's memory, held for all its processes together: a memory cgroup for each sandbox.

A sandbox's rlimits hold each of its processes to the job's memory limit (``RLIMIT_AS``), and
their number to ``max_processes``: a job forking 8 children of 400 MiB each held 3.2 GiB of the
host's memory. Each sandbox is also put in a memory cgroup of its own (cgroup v1's memory
controller, writable by a worker that runs as root: SANDBOX-NOTES.md), limited, when its job
starts, to the job's memory limit plus what its scratch filesystems may hold (their pages are
charged to it too). Past that, the kernel kills a process of the job, and the job, if the killed
process was its runner, ends ``ResourceLimit``.

Where no memory controller is writable (a worker not root, cgroup v2 without delegation), the
rlimits alone hold, and the worker says so once in its log.
"""

import atexit
import contextlib
import functools
import itertools
import logging
import os
import time
from pathlib import Path

logger = logging.getLogger("ptc.sandbox")
V1_MEMORY = Path("/sys/fs/cgroup/memory")
# How long the sandbox's runner may take to be forked (C forks I forks G) before it is given up on.
TREE_SECONDS = 2.0
_numbers = itertools.count(1)


class MemoryGroup:
    """One sandbox's memory cgroup."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def limit(self, nbytes: int) -> None:
        """Hold everything in the group to ``nbytes`` together."""
        (self.path / "memory.limit_in_bytes").write_text(str(nbytes))

    def oom_kills(self) -> int:
        """How many of the group's processes the kernel killed for its limit."""
        with contextlib.suppress(OSError, ValueError):
            for line in (self.path / "memory.oom_control").read_text().splitlines():
                name, _, value = line.partition(" ")
                if name == "oom_kill":
                    return int(value)
        return 0

    def remove(self) -> None:
        """Remove the group once its processes are gone (their exit may lag the sandbox's by a moment)."""
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:  # EBUSY: a process not reaped yet
                time.sleep(0.01)
        logger.warning("a sandbox's memory cgroup could not be removed: %s", self.path)


@functools.cache
def _parent(pid: int) -> Path | None:
    """The folder of process ``pid``'s sandbox groups, ``ptc-<pid>`` in its own memory cgroup (the
    host's limits on the worker hold its sandboxes too), made once; None where none can be made."""
    try:
        own = next(
            line.split(":", 2)[2].strip()
            for line in Path("/proc/self/cgroup").read_text().splitlines()
            if line.split(":", 2)[1] == "memory"
        )
        if not Path(f"/proc/{pid}/task/{pid}/children").exists():
            raise OSError("this kernel does not list a process's children (CONFIG_PROC_CHILDREN)")
        parent = V1_MEMORY / own.lstrip("/") / f"ptc-{pid}"
        parent.mkdir(exist_ok=True)
    except (OSError, StopIteration, IndexError) as exc:
        logger.warning("no writable memory cgroup (%s): each sandbox's processes are held to its memory limit one by one", exc)
        return None
    _sweep(parent.parent)
    _remove(parent, keep=True)  # what a worker gone that had this pid (a container restarted) left
    atexit.register(_remove, parent)  # its sandboxes die with it: their groups, then its folder, go too
    logger.info("each sandbox's processes are held to its memory limit together, in a memory cgroup (%s)", parent)
    return parent


def _sweep(own: Path) -> None:
    """Remove what workers that are gone left in ``own`` (empty: their sandboxes died with them)."""
    for folder in own.glob("ptc-*"):
        pid = folder.name.removeprefix("ptc-")
        if pid.isdecimal() and not Path(f"/proc/{pid}").exists():
            _remove(folder)


def _remove(folder: Path, keep: bool = False) -> None:
    """Remove a process's folder of groups (unless ``keep``) and the groups in it, those that are
    empty: a group whose sandbox is still alive stays, and so does its folder."""
    with contextlib.suppress(OSError):
        for group in folder.iterdir():
            if group.is_dir():
                group.rmdir()
        if not keep:
            folder.rmdir()


def memory_group(pid: int | None) -> MemoryGroup | None:
    """Put the sandbox whose outermost process is ``pid`` in a memory cgroup of its own, and return
    it; None if it can't be (no writable controller, or the sandbox ended first). The sandbox is
    three processes before its job (its namespaces' holder, its PID 1, its runner), each moved
    once the runner is forked: what the job forks later is born in the group."""
    parent = _parent(os.getpid())
    if parent is None or pid is None:
        return None
    tree = _tree(pid)
    if tree is None:
        return None
    group = MemoryGroup(parent / str(next(_numbers)))
    moved: list[int] = []
    try:
        group.path.mkdir()
        for member in tree:
            (group.path / "cgroup.procs").write_text(str(member))
            moved.append(member)
    except OSError as exc:
        logger.warning("a sandbox could not be put in its memory cgroup: %s", exc)
        for member in moved:  # back where they were, so that the group can go
            with contextlib.suppress(OSError):
                (parent.parent / "cgroup.procs").write_text(str(member))
        group.remove()
        return None
    return group


def _tree(pid: int) -> list[int] | None:
    """``pid``, its child and its grandchild (the sandbox's runner), once the runner is forked;
    None if the sandbox ended, or took over ``TREE_SECONDS``."""
    deadline = time.monotonic() + TREE_SECONDS
    while True:
        tree = [pid]
        with contextlib.suppress(OSError, ValueError):
            while len(tree) < 3:
                children = Path(f"/proc/{tree[-1]}/task/{tree[-1]}/children").read_text().split()
                if not children:
                    break
                tree.append(int(children[0]))
        if len(tree) == 3:
            return tree
        if not Path(f"/proc/{pid}").exists():
            return None
        if time.monotonic() > deadline:
            logger.warning("a sandbox's runner was not forked within %g s: no memory cgroup for it", TREE_SECONDS)
            return None
        time.sleep(0.001)
