"""The sandbox side of the bridge, shipped as ``ptc_tools/_runtime.py``. Standard library only.
Without a bridge (a sandbox on another host), calls go over HTTP with the job-scoped key (``_Http``).

Each tool call sends ``{"op": "call", "id", "toolset", "tool", "args"}`` and waits for the frame
with the same ``id``. Calls from many threads, or many asyncio tasks, are in flight at once; one
reader thread hands each reply to its caller. ``asyncio`` is imported only when ``.aio`` is used:
it costs ~50 ms to import.
"""

import os
import queue
import socket
import threading
from collections.abc import Callable
from typing import Any

from ptc_tools import _protocol


class ToolError(Exception):
    """A tool call failed. ``.tool`` is ``toolset.tool``, ``.code`` is stable, ``.message`` says why."""

    def __init__(self, message: str, *, tool: str = "", call_id: str = "", code: str = "tool_error") -> None:
        super().__init__(message)
        self.message = message
        self.tool = tool
        self.call_id = call_id
        self.code = code

    def __str__(self) -> str:
        return f"{self.tool}: {self.message} [{self.code}]" if self.tool else self.message


ToolError.__module__ = "ptc_tools"  # tracebacks name it as the user imports it


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


UNSET: Any = _Unset()


def args(**kwargs: Any) -> dict[str, Any]:
    """Return the arguments the caller gave, leaving out optional ones left unset."""
    return {k: v for k, v in kwargs.items() if v is not UNSET}


class _Bridge:
    def __init__(self, fd: int, start: dict[str, Any]) -> None:
        self._sock = socket.socket(fileno=fd)
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._pending: dict[int, Any] = {}
        self._next_id = 0
        self._closed: str | None = None
        # A session's next job comes on this bridge too, with its input files: as large as a first
        # job's frame may be (guest.MAX_JOB_FRAME). Its memory is the sandbox's own, under its limits.
        self._decoder = _protocol.FrameDecoder(64 << 20)
        self.start_message = start
        # A session's sandbox gets its next job as a ``start`` frame on the same bridge.
        self.jobs: queue.SimpleQueue[dict[str, Any] | None] = queue.SimpleQueue()
        threading.Thread(target=self._read_loop, name="ptc-bridge", daemon=True).start()

    def send(self, message: dict[str, Any], *, checked: bool = True) -> None:
        frame = _protocol.encode(message)
        limit = self.start_message.get("max_frame")
        if checked and limit and len(frame) > limit:
            raise ValueError(f"they are {len(frame)} bytes of JSON; the limit is {limit}")
        with self._send_lock:
            self._sock.sendall(frame)

    def _register(self, waiter: Any) -> int:
        with self._lock:
            if self._closed:
                raise ToolError(self._closed, code="bridge_closed")
            self._next_id += 1
            self._pending[self._next_id] = waiter
            return self._next_id

    def call(self, toolset: str, tool: str, arguments: dict[str, Any]) -> Any:
        return self._ask({"op": "call", "toolset": toolset, "tool": tool, "args": arguments}, toolset, tool)

    async def acall(self, toolset: str, tool: str, arguments: dict[str, Any]) -> Any:
        import asyncio

        loop = asyncio.get_running_loop()
        future = loop.create_future()
        message = {"op": "call", "toolset": toolset, "tool": tool, "args": arguments}
        self._request(self._register((loop, future)), message, f"{toolset}.{tool}")
        return _unwrap(await future, toolset, tool)

    def job_key(self, call_id: str) -> str:
        """Ask the worker for the key of the job ``call_id`` (it makes it on the first ask) and return it."""
        return str(self._ask({"op": "key", "call_id": call_id}, "job", "key"))

    def sdk_file(self, name: str, magic: str) -> dict[str, Any]:
        """Ask the worker for the job's SDK file ``name``: ``{"text", "code"}``, packed (see ``sdk_file``)."""
        return dict(self._ask({"op": "sdk", "name": name, "magic": magic}, "sdk", name))

    def _ask(self, message: dict[str, Any], toolset: str, tool: str) -> Any:
        """Send a request and wait for its reply, unwrapped."""
        done = threading.Event()
        box: list[Any] = [done, None]
        self._request(self._register(box), message, f"{toolset}.{tool}")
        done.wait()
        return _unwrap(box[1], toolset, tool)

    def _request(self, request_id: int, message: dict[str, Any], name: str) -> None:
        """Send request ``request_id``; if it can't be, forget its waiter and raise ToolError."""
        try:
            self.send({**message, "id": request_id})
        except ValueError as exc:
            with self._lock:
                self._pending.pop(request_id, None)
            raise ToolError(f"arguments cannot be sent: {exc}", tool=name, code="invalid_arguments") from None
        except OSError as exc:
            with self._lock:
                self._pending.pop(request_id, None)
            raise ToolError(f"the bridge is closed: {exc}", tool=name, code="bridge_closed") from None

    def _deliver(self, waiter: Any, reply: dict[str, Any]) -> None:
        if isinstance(waiter, list):
            waiter[1] = reply
            waiter[0].set()
        else:
            loop, future = waiter
            loop.call_soon_threadsafe(lambda: future.done() or future.set_result(reply))

    def _read_loop(self) -> None:
        reason = "the bridge closed"
        try:
            while True:
                data = self._sock.recv(1 << 16)
                if not data:
                    break
                for reply in self._decoder.feed(data):
                    if reply.get("op") == "start":
                        self.jobs.put(reply)
                        continue
                    with self._lock:
                        waiter = self._pending.pop(reply.get("id"), None)
                    if waiter is not None:
                        self._deliver(waiter, reply)
        except Exception as exc:  # a broken bridge fails every waiting call; it never hangs them
            reason = f"the bridge failed: {exc}"
        with self._lock:
            self._closed = reason
            waiters, self._pending = list(self._pending.values()), {}
        for waiter in waiters:
            self._deliver(waiter, {"ok": False, "error": {"code": "bridge_closed", "message": reason}})
        self.jobs.put(None)


def _unwrap(reply: dict[str, Any], toolset: str, tool: str) -> Any:
    if reply.get("ok"):
        return reply.get("result")
    error = reply.get("error") or {}
    raise ToolError(
        error.get("message", "the tool call failed"),
        tool=f"{toolset}.{tool}",
        call_id=reply.get("call_id", ""),
        code=error.get("code", "tool_error"),
    )


class JobInfo(dict[str, Any]):
    """What the code may know of its job: ``call_id``, and ``key``, the job-scoped key a sandbox on
    another host calls back with (Remote sandboxes). The key is made by the worker when the code
    first reads it: most jobs never do, and are spared its writes. Until then ``"key" in
    job_info`` is False and copies of it leave the key out: read ``job_info["key"]``."""

    def __missing__(self, name: str) -> Any:
        if name != "key":
            raise KeyError(name)
        if _bridge is None:
            raise ToolError(_NO_BRIDGE, tool="job.key", code="no_bridge")
        self[name] = _bridge.job_key(str(dict.get(self, "call_id", "")))
        return self[name]

    def get(self, name: str, default: Any = None) -> Any:
        try:
            return self[name]
        except KeyError:
            return default


job_info: JobInfo = JobInfo()
# The sandbox's bridge (the runner connects it), kept should the code reload this module:
# importlib.reload runs it again in the same namespace, and the bridge is the sandbox's, not the module's.
_bridge: _Bridge | None = globals().get("_bridge")


def sdk_file(name: str, magic: str = "") -> tuple[str, bytes | None]:
    """Return the job's SDK file ``name`` (``ptc_tools/github.py``) from the worker: its text, and
    for a module, when the worker's interpreter has this bytecode ``magic``, its code
    (marshalled), else None."""
    if _bridge is None:
        raise ToolError(_NO_BRIDGE, tool=f"sdk.{name}", code="no_bridge")
    got = _bridge.sdk_file(name, magic)
    code = got.get("code")
    return _protocol.unpack(got["text"]).decode(), None if code is None else _protocol.unpack(code)


# In a sandbox: makes sure the job's SDK file ``name`` is on disk, fetched from the worker on first
# use (the runner sets it; kept across a reload, as the bridge is). Elsewhere (an SDK downloaded
# whole) every file is there already.
sdk_need: Callable[[str], None] = globals().get("sdk_need") or (lambda name: None)
# In a sandbox: the folders of the job's SDK, which the runner adds to the package's path; the
# package adds them again when it is reloaded (which resets its path). Kept across a reload too.
sdk_paths: list[str] = globals().get("sdk_paths") or []
_NO_BRIDGE = "tools can be called only from the sandbox's main process (not outside PTC, nor from a fork)"


def _forked() -> None:
    # A forked child shares the bridge socket but not its reader thread or locks: its frames
    # would interleave with the parent's. Only the sandbox's main process may call tools.
    global _bridge
    _bridge = None


def connect(fd: int, start: dict[str, Any]) -> None:
    """Open the bridge on ``fd``, whose first frame, the job, the runner has read: ``start``."""
    global _bridge
    _bridge = _Bridge(fd, start)
    os.register_at_fork(after_in_child=_forked)


def next_job() -> dict[str, Any] | None:
    """A session's sandbox: wait for the next job's ``start`` frame; None once the bridge closed."""
    if _bridge is None:
        return None
    job = _bridge.jobs.get()
    if job is not None:
        _bridge.start_message = job
    return job


def connected() -> bool:
    """Return True in the process that owns the bridge (not in a forked child)."""
    return _bridge is not None


def send(message: dict[str, Any], *, checked: bool = True) -> None:
    """Send ``message``; with ``checked``, refuse one over the job's max_frame (the runner sends its
    result unchecked: it checked the value itself, and the files it carries have their own quota)."""
    if _bridge is None:
        raise RuntimeError("the bridge is not connected")
    _bridge.send(message, checked=checked)


def call(toolset: str, tool: str, arguments: dict[str, Any]) -> Any:
    """Call ``toolset.tool`` and return its result, or raise ToolError."""
    if _bridge is None:
        http = _http()
        if http is not None:
            return http.call(toolset, tool, arguments)
        raise ToolError(_NO_BRIDGE, tool=f"{toolset}.{tool}", code="no_bridge")
    return _bridge.call(toolset, tool, arguments)


async def acall(toolset: str, tool: str, arguments: dict[str, Any]) -> Any:
    """The asyncio form of ``call``."""
    if _bridge is None:
        http = _http()
        if http is not None:
            import asyncio

            return await asyncio.to_thread(http.call, toolset, tool, arguments)
        raise ToolError(_NO_BRIDGE, tool=f"{toolset}.{tool}", code="no_bridge")
    return await _bridge.acall(toolset, tool, arguments)


class _Http:
    """Tool calls over HTTP, for a sandbox on a host without the bridge: POST /api/v1/tools/execute
    with the job-scoped key and the job's call_id. The server holds them to the job's limits as the
    bridge would: past its parallel cap it answers 429 parallel_limit and the call waits here."""

    def __init__(self, url: str, key: str, call_id: str) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"PTC_API_URL must be an http(s) URL; got {url!r}")
        self.url = url.rstrip("/") + "/api/v1/tools/execute"
        self.headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json", "x-ptc-call-id": call_id}

    def call(self, toolset: str, tool: str, arguments: dict[str, Any]) -> Any:
        import http.client
        import time
        import urllib.error
        import urllib.request

        # The protocol's JSON, as a frame is: bound before the code ran (code that replaces
        # json.dumps or json.loads can't break its calls), and strict (NaN and infinities are
        # refused here, as the bridge's SDK refuses them, not posted for the API to fail to parse).
        dumps, loads = _protocol.json_dumps, _protocol.json_loads
        name = f"{toolset}.{tool}"
        try:
            body = dumps({"toolset": toolset, "tool": tool, "arguments": arguments}, allow_nan=False).encode()
        except ValueError as exc:
            raise ToolError(f"arguments cannot be sent: {exc}", tool=name, code="invalid_arguments") from None
        pause = 0.02
        while True:
            # The scheme was checked in __init__: http or https only.
            request = urllib.request.Request(self.url, data=body, headers=self.headers, method="POST")  # noqa: S310
            try:
                with urllib.request.urlopen(request, timeout=3600) as response:  # noqa: S310  # the server bounds the call
                    answer = response.read()
                break
            except urllib.error.HTTPError as exc:
                # What answers may not be the API (a proxy's page): its error is read if it is one.
                try:
                    error = loads(exc.read() or b"{}").get("error") or {}
                except (ValueError, AttributeError, OSError, http.client.HTTPException):
                    error = {}
                error = error if isinstance(error, dict) else {}
                if exc.code == 429 and error.get("code") == "parallel_limit":
                    time.sleep(pause)  # a slot frees when one of this job's calls ends
                    pause = min(pause * 2, 0.5)
                    continue
                raise ToolError(error.get("message", str(exc)), tool=name, code=error.get("code", "tool_error")) from None
            except (OSError, http.client.HTTPException) as exc:  # unreachable, or cut off as it answered
                reason = f"the API could not be reached: {type(exc).__name__}: {exc}"
                raise ToolError(reason, tool=name, code="bridge_closed") from None
        try:
            record = loads(answer)
        except ValueError:
            record = None
        if not isinstance(record, dict):
            raise ToolError(f"the API's answer is not a tool call's record: {answer[:200]!r}", tool=name, code="internal_error")
        if record.get("status") == "completed":
            return record.get("output")
        error = record.get("error") or {}
        raise ToolError(
            error.get("message", "the tool call failed"),
            tool=name,
            call_id=record.get("call_id", ""),
            code=error.get("code", "tool_error"),
        )


_http_client: _Http | None = None


def connect_http(url: str, key: str, call_id: str) -> None:
    """Make tool calls over HTTP to the API at ``url`` (a sandbox without the bridge)."""
    global _http_client
    _http_client = _Http(url, key, call_id)


def _http() -> _Http | None:
    """The HTTP client: set by connect_http, or from PTC_API_URL, PTC_JOB_KEY and PTC_JOB_CALL_ID."""
    if _http_client is None and all(os.environ.get(n) for n in ("PTC_API_URL", "PTC_JOB_KEY", "PTC_JOB_CALL_ID")):
        connect_http(os.environ["PTC_API_URL"], os.environ["PTC_JOB_KEY"], os.environ["PTC_JOB_CALL_ID"])
    return _http_client
