"""The sandbox's main program. Runs under the sandbox's own interpreter, standard library only.

The fork server (``zygote.py``) imports it and the SDK's base package (``prepare``) once, and each
sandbox it forks calls ``main(BRIDGE_FD, SDK_DIR)``. It may run long before its job (a warm
sandbox): it waits for the job, the first bridge frame, which carries the code, the limits and the names
of the job's SDK files (its toolsets' modules and their catalog), each asked of the worker when
first used and written to SDK_DIR (a tmpfs of this sandbox's own). It sets its own resource
limits before any user code runs (it has no capabilities, so the code can never raise them
again), runs the code, and sends one ``done`` frame with the value of the last expression or the
error.

A session's sandbox (``"session": true`` in the job) does not exit after ``done``: it waits for the
next ``start`` frame and runs it in the same namespace, with the same ``/work`` and limits. A job
may bring input files (``files``, base64 by path under /work) and ask for the files its code wrote
(``collect_files``, a quota): they come back in ``done``.
"""

import _ast
import base64
import builtins
import collections
import contextlib
import errno
import importlib.util
import marshal
import os
import resource
import select
import signal
import socket
import stat
import sys
import threading
import traceback
from typing import Any

# Every module imported here is paid for by every sandbox's start: not ``ast`` (its C core, ``_ast``,
# does what the runner needs). What reports the code's end is imported here, though not every job
# needs it: imported then, it could fail for the state the code left (its memory full, its
# recursion limit low, sys.modules changed), and the report with it.

CODE_NAME = "<exec_code>"
THREAD_STACK_BYTES = 1 << 20
# A traceback keeps the outermost and the innermost frames of the code: one raised from a million
# frames deep is reported at once, not after formatting a million lines.
TRACEBACK_HEAD = 10
TRACEBACK_TAIL = 40
# The job's frame carries its SDK: a catalog of thousands of tools is megabytes of source.
MAX_JOB_FRAME = 64 << 20
WORK = "/work"
# A /work of more files than this is not walked further for the files a job changed.
MAX_SCANNED_FILES = 10_000
# Written and removed in the SDK's folder by the warm-up: no module can have the name.
WARM_UP_FILE = ".warm-up"
# What the runner waits with after its job's result, taken before the code runs: the code shares
# the ``select`` module, and may change it.
_select = select.select


def _set_limits(limits: dict[str, int]) -> None:
    pairs = {
        resource.RLIMIT_AS: limits["memory_bytes"],
        resource.RLIMIT_NPROC: limits["max_processes"],
        resource.RLIMIT_FSIZE: limits["max_file_bytes"],
        resource.RLIMIT_NOFILE: limits["max_open_files"],
        resource.RLIMIT_CORE: 0,
    }
    for which, value in pairs.items():
        resource.setrlimit(which, (value, value))
    cpu = limits["cpu_seconds"]
    # Soft limit first: SIGXCPU ends the process, and the worker reports it as a CPU limit.
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    # An over-size write raises EFBIG instead of killing the process with SIGXFSZ.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    # Each thread's stack counts against RLIMIT_AS: at the default 8 MiB, a pool of 100 threads
    # calling tools would need 800 MiB of address space it never touches.
    threading.stack_size(THREAD_STACK_BYTES)


def _jsonable(value: Any) -> Any:
    """Return ``value`` if it is strict JSON, else its repr (or a placeholder if even that fails)."""
    from ptc_tools import _protocol  # its json's: the code may have replaced the module's

    try:
        _protocol.json_dumps(value, allow_nan=False)
        return value
    except (TypeError, ValueError, RecursionError):
        pass
    try:
        return repr(value)
    except BaseException:  # a __repr__ that raises, or recursion too deep to print
        return f"<unrepresentable {type(value).__name__}>"


def _describe(exc: BaseException) -> str:
    try:
        return str(exc)
    except BaseException:  # an exception whose __str__ raises is still reported
        return f"<{type(exc).__name__} whose message could not be read>"


def _frames(tb: Any) -> str:
    """The code's own frames of ``tb``, formatted: the first TRACEBACK_HEAD and the last
    TRACEBACK_TAIL, with a line saying how many were left out between them."""
    head: list[tuple[Any, int]] = []
    tail: collections.deque[tuple[Any, int]] = collections.deque(maxlen=TRACEBACK_TAIL)
    total = 0
    for frame, lineno in traceback.walk_tb(tb):
        if frame.f_code.co_filename != CODE_NAME:
            continue
        total += 1
        (head if len(head) < TRACEBACK_HEAD else tail).append((frame, lineno))
    left_out = total - len(head) - len(tail)
    gap = f"  [... {left_out} more frames ...]\n" if left_out else ""
    return _format(head) + gap + _format(list(tail))


def _format(frames: list[tuple[Any, int]]) -> str:
    return "".join(traceback.StackSummary.extract(iter(frames), lookup_lines=False).format())


def _error(exc: BaseException, limits: dict[str, int]) -> dict[str, Any]:
    from ptc_tools import ToolError

    trace = "Traceback (most recent call last):\n" + _frames(exc.__traceback__)
    try:
        trace += "".join(traceback.format_exception_only(type(exc), exc))
    except BaseException:  # see _describe
        trace += f"{type(exc).__name__}\n"
    kind, message = type(exc).__name__, _describe(exc)
    if isinstance(exc, ToolError):
        message = exc.message
    elif isinstance(exc, MemoryError):
        kind, message = "ResourceLimit", f"memory limit of {limits['memory_bytes'] // (1 << 20)} MiB reached"
    elif isinstance(exc, OSError) and exc.errno == errno.EFBIG:
        kind, message = "ResourceLimit", f"file size limit of {limits['max_file_bytes']} bytes reached"
    elif isinstance(exc, BlockingIOError) and exc.errno == errno.EAGAIN and "socket" not in trace:
        # fork() and subprocess fail with EAGAIN at RLIMIT_NPROC.
        kind, message = "ResourceLimit", f"process limit of {limits['max_processes']} reached"
    error: dict[str, Any] = {"type": kind, "message": message, "traceback": trace}
    if isinstance(exc, ToolError):
        error.update(tool=exc.tool, call_id=exc.call_id, code=exc.code)
    return error


def _compile(source: str) -> tuple[Any, bool]:
    """Compile ``source``, binding its last expression to ``__ptc_result__``.

    Return the code object and whether the last statement was an expression. (``ast.parse`` is
    ``compile`` with ``PyCF_ONLY_AST``; the one node made here gets its position from the
    expression it replaces.)
    """
    tree: Any = compile(source, CODE_NAME, "exec", flags=_ast.PyCF_ONLY_AST, dont_inherit=True)  # an _ast.Module
    last = tree.body[-1] if tree.body else None
    has_value = isinstance(last, _ast.Expr)
    if isinstance(last, _ast.Expr):
        where = {name: getattr(last, name) for name in ("lineno", "col_offset", "end_lineno", "end_col_offset")}
        target = _ast.Name(id="__ptc_result__", ctx=_ast.Store(), **where)
        tree.body[-1] = _ast.Assign(targets=[target], value=last.value, **where)
    return compile(tree, CODE_NAME, "exec", flags=_ast.PyCF_ALLOW_TOP_LEVEL_AWAIT, dont_inherit=True), has_value


def _read_job(bridge_fd: int, protocol: Any) -> dict[str, Any]:
    """Wait for the job: the bridge's first frame. A warm sandbox waits here, before anything of a
    job is in it, until its worker hands it one."""
    sock = socket.socket(fileno=bridge_fd)
    decoder = protocol.FrameDecoder(MAX_JOB_FRAME)
    try:
        while True:
            data = sock.recv(1 << 16)
            if not data:
                os._exit(0)  # the worker let this sandbox go unused (a warm one, at shutdown)
            messages = decoder.feed(data)
            if messages:
                # The worker sends nothing else before the code has run and called a tool.
                if len(messages) > 1 or decoder.pending_bytes:
                    raise SystemExit("ptc: the worker sent more than the job before the code started")
                return messages[0]
    finally:
        sock.detach()  # the fd stays open: the SDK's runtime takes it over


def _install_sdk(files: dict[str, str], sdk_dir: str) -> None:
    """Write the job's generated ``ptc_tools`` package, sent with the job, where it is imported from."""
    root = os.path.realpath(sdk_dir)
    for name, content in files.items():
        path = os.path.realpath(os.path.join(root, name))
        if not path.startswith(root + os.sep):
            raise SystemExit(f"ptc: the SDK file {name!r} is outside the SDK")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(content)


class _LazySdk:
    """The job's SDK files, each fetched from the worker when first used: a toolset's module when
    it is imported, the catalog when ``describe``, ``search`` or the flat ``tools`` first read it.
    A job that never imports GitHub's module does not carry its source, nor the catalog of its
    tools (hundreds of kilobytes, each way encoded and decoded). An import hook (``sys.meta_path``):
    the file is written to the SDK's folder, then imported from there as any source file. Until
    then each module is an empty file there, so that ``help(ptc_tools)`` and ``pkgutil`` list it."""

    def __init__(self, sdk_dir: str, fetch: Any, forget: Any) -> None:
        self.sdk_dir = sdk_dir
        self.fetch = fetch  # the runtime's sdk_file: a file's text and bytecode, asked of the worker
        self.forget = forget  # the discovery's: the catalog it read is read again
        self.names: frozenset[str] = frozenset()  # the job's SDK files
        self.fetched: dict[str, str] = {}  # their text, once asked (written again if its write failed)
        self.written: set[str] = set()
        self.code: dict[str, Any] = {}  # a module's code the worker compiled, until it is imported
        # The code's threads import and read the catalog at once: each file is asked for once.
        # Reentrant: nothing under it imports today, and a change that did must not hang the job.
        self.lock = threading.RLock()

    def reset(self, names: list[str]) -> None:
        """A job's SDK: its files' names. A session's job whose SDK changed forgets the earlier
        one: its files (what the code left of them), its modules imported (an import imports the
        new one; what the session's globals hold stays as it was) and the catalog read."""
        with self.lock:
            package = sys.modules.get("ptc_tools")
            for name in self.names:
                module = name[: -len(".py")].replace("/", ".") if name.endswith(".py") else ""
                if sys.modules.pop(module, None) is not None and package is not None:
                    vars(package).pop(module.rpartition(".")[2], None)  # ``from ptc_tools import x`` reads it
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(self.sdk_dir, name))
            self.names, self.fetched, self.written, self.code = frozenset(names), {}, set(), {}
            with contextlib.suppress(OSError):  # a folder the code broke: the imports will say
                _install_sdk({name: "" for name in names if name.endswith(".py")}, self.sdk_dir)
            self.forget()

    def need(self, name: str) -> None:
        with self.lock:
            if name not in self.names or name in self.written:
                return
            if name not in self.fetched:
                text, code = self.fetch(name, importlib.util.MAGIC_NUMBER.hex())
                if code is not None:
                    self.code[name] = marshal.loads(code)  # noqa: S302 - from the worker, which sent the job
                self.fetched[name] = text
            _install_sdk({name: self.fetched[name]}, self.sdk_dir)
            self.written.add(name)

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        name = fullname.replace(".", "/") + ".py"
        if name not in self.names:
            return None
        self.need(name)
        with self.lock:
            code = self.code.pop(name, None)  # once: a reload compiles the file, which may have changed
        loader: Any = None if code is None else _CodeLoader(code)  # a loader as importlib.abc's, without importing it
        return importlib.util.spec_from_file_location(fullname, os.path.join(self.sdk_dir, name), loader=loader)


class _CodeLoader:
    """Runs a module's code, compiled by the worker (its source is on disk beside, for tracebacks)."""

    def __init__(self, code: Any) -> None:
        self.code = code

    def create_module(self, spec: Any) -> None:
        return None

    def exec_module(self, module: Any) -> None:
        exec(self.code, module.__dict__)  # noqa: S102 - the SDK's own module, compiled by the worker


def _work_path(path: str) -> str:
    """The absolute path of ``path`` under /work, or ValueError: the worker checked it already;
    this is the guard, against a symlink the code made, too."""
    parts = path.split("/")
    if not path or "\0" in path or path.startswith("/") or any(part in ("", ".", "..") for part in parts):
        raise ValueError(f"the file path {path!r} is not a plain path under /work")
    target = os.path.join(WORK, *parts)
    parent = os.path.realpath(os.path.dirname(target))
    if parent != WORK and not parent.startswith(WORK + os.sep):
        raise ValueError(f"the file path {path!r} leads out of /work")
    return target


class InputFileError(Exception):
    """An input file could not be written under /work: the job ends ``InputFiles`` before its code runs."""


def _write_files(files: dict[str, str]) -> None:
    """Write the job's input files (base64) under /work; a symlink in their place is not followed.
    Raise InputFileError naming the first that can't be (a folder or a symlink the code made in its
    place, a name too long)."""
    for path, data in files.items():
        try:
            target = _work_path(path)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            if os.path.realpath(os.path.dirname(target)) != os.path.dirname(target):
                raise ValueError(f"the file path {path!r} leads out of /work")
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
            with os.fdopen(fd, "wb") as f:
                f.write(base64.b64decode(data))
        except (OSError, ValueError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise InputFileError(
                f"the file {path!r} could not be written to /work ({why}), so the code was not run; "
                "it stays to be sent with the next job: replace or delete it"
            ) from None


def _scan() -> tuple[dict[str, tuple[int, int, int]], bool]:
    """The regular files under /work (symlinks are not followed nor reported), with what tells a
    changed one: inode, size, mtime; and whether that is all of them (at most MAX_SCANNED_FILES)."""
    seen: dict[str, tuple[int, int, int]] = {}
    for root, dirs, names in os.walk(WORK):
        dirs.sort()
        for name in sorted(names):
            full = os.path.join(root, name)
            try:
                st = os.lstat(full)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                seen[os.path.relpath(full, WORK)] = (st.st_ino, st.st_size, st.st_mtime_ns)
            if len(seen) >= MAX_SCANNED_FILES:
                return seen, False
    return seen, True


def _changed_files(before: dict[str, tuple[int, int, int]], quota: dict[str, int]) -> dict[str, Any]:
    """The files the code wrote or changed (base64, within the quota: the rest are named in
    ``files_omitted``) and those it removed."""
    after, whole = _scan()
    files: list[dict[str, str]] = []
    omitted: list[str] = []
    total = 0
    for path, (_, size, _) in after.items():
        if before.get(path) == after[path]:
            continue
        if len(files) >= quota["max_count"] or total + size > quota["max_bytes"]:
            omitted.append(path)
            continue
        try:
            # Not followed if the code put a symlink in its place since the scan.
            fd = os.open(os.path.join(WORK, path), os.O_RDONLY | os.O_NOFOLLOW)
            with os.fdopen(fd, "rb") as f:
                data = f.read(quota["max_bytes"] - total + 1)
        except OSError:
            omitted.append(path)
            continue
        if total + len(data) > quota["max_bytes"]:  # it grew since the scan
            omitted.append(path)
            continue
        total += len(data)
        files.append({"path": path, "data": base64.b64encode(data).decode()})
    # A scan cut short at MAX_SCANNED_FILES did not see every file: what it missed was not removed.
    removed = sorted(set(before) - set(after)) if whole else []
    return {"files": files, "files_omitted": omitted, "files_removed": removed}


def _run(job: dict[str, Any], namespace: dict[str, Any], limits: dict[str, int]) -> dict[str, Any]:
    """Run one job's code in ``namespace``; return its ``done`` frame."""
    from ptc_tools import _protocol

    result: dict[str, Any] = {"op": "done", "return_value": None, "error": None}
    namespace.pop("__ptc_result__", None)
    try:
        code, has_value = _compile(job["code"])
        value = eval(code, namespace)
        if value is not None:  # top-level await: the module compiled to a coroutine
            import asyncio

            asyncio.run(value)
        if has_value and _protocol.nests_deeper(namespace.get("__ptc_result__"), job["max_depth"]):
            result["error"] = {
                "type": "ResourceLimit",
                "message": f"the return value nests deeper than {job['max_depth']} levels: return a flatter value",
                "traceback": "",
            }
        elif has_value:
            result["return_value"] = _jsonable(namespace.get("__ptc_result__"))
    except SystemExit as exc:
        if exc.code not in (None, 0):
            result["error"] = {"type": "SystemExit", "message": f"exit status {exc.code}", "traceback": ""}
    except BaseException as exc:  # everything the code raises is the job's error, reported whole
        try:
            result["error"] = _error(exc, limits)
        except BaseException:  # reporting must not fail however odd the exception
            result["error"] = {"type": "Exception", "message": "the code raised an exception that could not be reported"}
    size = len(_protocol.encode(result))
    if size > job["max_frame"]:
        result["return_value"] = None
        result["error"] = result["error"] or {
            "type": "ResourceLimit",
            "message": f"the return value is {size} bytes of JSON; the limit is {job['max_frame']}: print it instead",
            "traceback": "",
        }
    return result


def prepare() -> None:
    """Import the SDK's base package, staged beside this runner: imported before the job comes
    (by the fork server, once for all its sandboxes), it costs the job nothing. The job brings its
    toolsets' modules, which join the package."""
    # The interpreter runs with -S: the builtins ``site`` adds (help, exit, quit), which code
    # written for a plain Python uses, are added here, and only those: sys.path stays as it is.
    import site

    site.sethelper()
    site.setquit()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import ptc_tools  # noqa: F401
    from ptc_tools import _protocol, _runtime, tools  # noqa: F401


def _warm_up(sdk_dir: str, protocol: Any) -> None:
    """Take once, while this sandbox waits for its job, the paths every job takes in here: a file
    written to the SDK's folder, a thread started, code compiled and run, a frame encoded and
    decoded, /work scanned. A forked sandbox's pages are the fork server's until it first writes
    them, and merely using an object writes to it (its reference count): a job paid those copies
    on its own path, about 1.5 ms of the 2.5 it spent in here. Leaves nothing behind."""
    _install_sdk({WARM_UP_FILE: ""}, sdk_dir)
    os.unlink(os.path.join(sdk_dir, WARM_UP_FILE))
    thread = threading.Thread(target=int, daemon=True)
    thread.start()
    thread.join()
    code, _ = _compile("x = 1\nx")
    eval(code, {"__builtins__": builtins})
    protocol.FrameDecoder(1 << 10).feed(protocol.encode({"op": "done", "return_value": None, "error": None}))
    _scan()


def main(bridge_fd: int, sdk_dir: str) -> None:
    """Wait for the job on ``bridge_fd``, run it (a session's: its jobs), and exit."""
    import ptc_tools
    from ptc_tools import _discovery, _protocol, _runtime, tools

    if not select.select([bridge_fd], [], [], 0)[0]:  # a warm sandbox: its job is not here yet
        try:
            _warm_up(sdk_dir, _protocol)
        except Exception:  # only ever a saving: the job takes the same paths, and says what fails
            pass
    job: dict[str, Any] | None = _read_job(bridge_fd, _protocol)
    assert job is not None
    sdk = _LazySdk(sdk_dir, _runtime.sdk_file, _discovery.forget)
    sys.meta_path.insert(0, sdk)
    _runtime.sdk_need = sdk.need
    _runtime.sdk_paths.append(os.path.join(sdk_dir, "ptc_tools"))
    ptc_tools.__path__.append(_runtime.sdk_paths[-1])
    _runtime.connect(bridge_fd, job)
    # Set once: a session's later jobs run under the same limits (its rlimits can't be raised again).
    limits = job["limits"]
    _set_limits(limits)
    # A session's sandbox runs job after job in this one namespace (one module's globals).
    persistent = bool(job.get("session"))
    # The seed's flat style: ``tools.list_files(path=".")`` without an import.
    namespace: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins, "tools": tools}
    while job is not None:
        if job.get("sdk") is not None:  # a session's later job names its SDK's files only if it changed
            sdk.reset(job.pop("sdk"))
        # The job's call_id, and its job-scoped key (made when first read): what a sandbox
        # elsewhere would call back with.
        _runtime.job_info = _runtime.JobInfo(job.get("job", {}))
        quota = job.get("collect_files")
        before: dict[str, tuple[int, int, int]] = {}
        try:
            _write_files(job.get("files") or {})
            if quota:
                before, _ = _scan()
        except InputFileError as exc:  # fails the job, not the sandbox (a session's goes on)
            error = {"type": "InputFiles", "message": str(exc), "traceback": ""}
            result: dict[str, Any] = {"op": "done", "return_value": None, "error": error}
        except BaseException as exc:
            result = {"op": "done", "return_value": None, "error": _error(exc, limits)}
        else:
            result = _run(job, namespace, limits)
            if quota:
                try:
                    result.update(_changed_files(before, quota))
                except BaseException as exc:  # reported with the result; the files are left out
                    result["files_error"] = _describe(exc)
        if not _runtime.connected():
            os._exit(1 if result["error"] else 0)  # a forked child's end is not the job's end
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # a closed or broken stream must not hide the result
                pass
        # Its job's call_id, which the worker checks: a result the code sent itself for a job of
        # the session's that has ended can't be taken for the next one's.
        result["job"] = (job.get("job") or {}).get("call_id")
        try:
            _runtime.send(result, checked=False)
        except Exception as exc:  # the worker reports a missing result as SandboxCrashed; say why here
            os.write(2, f"ptc: the result could not be sent: {type(exc).__name__}: {exc}\n".encode())
            os._exit(70)
        if not persistent:
            break
        del result
        job = _runtime.next_job()  # None: the worker closed the bridge (the session ended)
    if not persistent:
        # The worker kills it once the job's end is out: its teardown is not on the client's path.
        # Its end of the bridge closing (the worker gone) ends it too.
        with contextlib.suppress(BaseException):
            _select([bridge_fd], [], [])
    # Daemon threads or stray user threads must not keep the sandbox alive after the result.
    os._exit(0)
