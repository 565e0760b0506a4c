"""The ``mcp`` kind: tools of an MCP server over stdio or streamable HTTP, with the official ``mcp`` SDK.

Config, one of:
- ``{"transport": "stdio", "command": "...", "args": [...], "env": {...}, "init_timeout": 10}``
- ``{"transport": "streamable_http", "url": "...", "headers": {...}, "init_timeout": 10}``
Values in ``env`` and ``headers`` may use ``{{secrets.NAME}}``.

Sessions are pooled per process. A tools worker runs calls on many threads (Celery's threads pool),
but the SDK is asyncio: one event loop runs in a daemon thread and owns every session; a call is a
coroutine submitted to it with ``run_coroutine_threadsafe``. One session per toolset serves every
thread at once (MCP multiplexes requests by id), so a stdio server is started once per worker
process, not once per call. Each session has an owner task that opened it and is the only one to
close it: the SDK's transports are anyio task groups, which must be exited by the task that entered
them. ``sessions_close`` ends them all; the tools worker calls it at shutdown, and ``atexit`` backs
it up. Closing a stdio session closes the server's stdin, then terminates its process group.
"""

import asyncio
import atexit
import codecs
import concurrent.futures
import contextlib
import contextvars
import functools
import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from signal import Signals
from typing import Any, TypeVar

import anyio
import anyio.abc
from django.conf import settings

from tools.arguments import arguments_error, arguments_validator
from tools.errors import ToolFailure
from tools.kinds import inflate
from tools.models import Tool, Toolset
from tools.secret_refs import (
    MissingSecret,
    headers_ascii,
    headers_problem,
    secrets_redact,
    secrets_redact_value,
    secrets_render_map,
    secrets_tail,
)

logger = logging.getLogger("ptc.tools")

TRANSPORTS = ("stdio", "streamable_http")
DEFAULT_INIT_TIMEOUT = 10.0
# A session nobody called for this long is closed: a stdio server is a process held for nothing.
IDLE_SECONDS = 600.0
_REAP_EVERY = 30.0
# Closing waits for each server to exit: the SDK gives it 2 s after stdin closes, then 2 s after SIGTERM.
_CLOSE_SECONDS = 10.0
_STDERR_TAIL_CHARS = 4000
# The most pages a tool list is read in: 10,000 tools (where it stops) at one a page.
_MAX_PAGES = 10_000
_EXCERPT_CHARS = 300
# The longest line of a stdio server's stdout read: its transport is a JSON-RPC message a line, and
# an answer a call may take holds its output at most twice, as text (escaped) and as structured content.
# The same bound holds an answer over HTTP, as JSON or as an event.
MAX_LINE_BYTES = 4 * settings.PTC_MAX_TOOL_OUTPUT_BYTES
# The most a tools' listing is read to, all its pages: each page is a line, and a server naming
# page after page would be read until the 10,000th tool, each tool as large as a line.
MAX_LISTING_BYTES = 4 * MAX_LINE_BYTES
T = TypeVar("T")


@dataclass(frozen=True)
class Server:
    """How to reach one toolset's MCP server, with its secrets filled in. Never logged or stored."""

    transport: str
    toolset_key: str = ""
    command: str = ""
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    url: str = ""
    headers: tuple[tuple[str, str], ...] = ()
    init_timeout: float = DEFAULT_INIT_TIMEOUT
    secrets: tuple[str, ...] = field(default=(), repr=False)

    @property
    def fingerprint(self) -> str:
        """A digest of everything that makes a session: an edited config or secret gets a new one."""
        parts = [self.transport, self.command, self.args, self.env, self.url, self.headers, self.init_timeout]
        return hashlib.sha256(json.dumps(parts, default=list).encode()).hexdigest()

    def describe(self) -> str:
        # By its toolset, not its URL: a global toolset's config is its operator's (no tenant reads
        # it), and a hosted server's URL holds its host and often the token it is reached by.
        return f"of toolset '{self.toolset_key}'"


def server_for(toolset: Toolset) -> Server:
    """Return how to reach ``toolset``'s server. Raise ToolFailure if its config can't say."""
    config = toolset.config or {}
    secrets: dict[str, str] = toolset.secrets or {}
    transport = config.get("transport", "stdio")
    init_timeout = float(config.get("init_timeout") or DEFAULT_INIT_TIMEOUT)
    try:
        if transport == "stdio" and config.get("command"):
            return Server(
                transport=transport,
                toolset_key=toolset.key,
                command=str(config["command"]),
                args=tuple(str(a) for a in config.get("args") or ()),
                env=tuple(sorted(secrets_render_map(config.get("env"), secrets).items())),
                init_timeout=init_timeout,
                secrets=tuple(str(v) for v in secrets.values()),
            )
        if transport == "streamable_http" and config.get("url"):
            headers = secrets_render_map(config.get("headers"), secrets)
            # Refused as it is written; checked cheaply on every call, the templates only to say why.
            if not headers_ascii(headers) and (problem := headers_problem(config.get("headers"), secrets)):
                raise ToolFailure("mcp_config_invalid", f"toolset '{toolset.key}': its header {problem}; an admin must change it")
            return Server(
                transport=transport,
                toolset_key=toolset.key,
                url=str(config["url"]),
                headers=tuple(sorted(headers.items())),
                init_timeout=init_timeout,
                secrets=tuple(str(v) for v in secrets.values()),
            )
    except MissingSecret as missing:
        raise ToolFailure("secret_missing", f"the toolset's config uses the secret '{missing.name}', which is not set") from None
    raise ToolFailure(
        "mcp_config_invalid",
        f'toolset \'{toolset.key}\' needs config {{"transport": "stdio", "command": ...}} '
        'or {"transport": "streamable_http", "url": ...}',
    )


def _leaf(exc: BaseException) -> BaseException:
    """Return the first real error inside the SDK's (nested) exception groups."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def _excerpt(text: str, server: Server) -> str:
    if server.url:  # httpx's errors quote the URL they were sent to ("... for url 'https://...'")
        text = text.replace(server.url, "[the server's URL]")
    text = " ".join(secrets_redact(text, server.secrets).split())
    return text if len(text) <= _EXCERPT_CHARS else "…" + text[-_EXCERPT_CHARS:]


class _StderrTail:
    """A stdio server's stderr: a pipe whose last few KB are kept, to say why a server failed.

    Read by the event loop, so nothing blocks on a chatty server, and nothing of it is logged: a
    server may print its own configuration, secrets included. What is kept is cut where no secret
    is (``secrets_tail``), and read redacted.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, secrets: tuple[str, ...]) -> None:
        self._loop = loop
        self._secrets = secrets
        self._read_fd, write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)
        self.writer = os.fdopen(write_fd, "w")
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._tail = ""
        self._open = True
        loop.add_reader(self._read_fd, self._drain)

    def spawned(self) -> None:
        """Drop our copy of the write end once the child has its own, so EOF arrives when it exits."""
        if not self.writer.closed:
            self.writer.close()

    def _drain(self) -> None:
        while self._open:
            try:
                data = os.read(self._read_fd, 65536)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:
                self.close()
                return
            self._tail = secrets_tail(self._tail + self._decoder.decode(data), _STDERR_TAIL_CHARS, self._secrets)

    def text(self) -> str:
        """Return the end of what the server wrote on stderr, its secrets redacted."""
        self._drain()
        return secrets_redact(self._tail, self._secrets)

    def close(self) -> None:
        self.spawned()
        if self._open:
            self._open = False
            self._loop.remove_reader(self._read_fd)
            os.close(self._read_fd)


class _Lines(anyio.abc.ByteReceiveStream):
    """A stdio server's stdout, handed on whole lines at a time, each at most about MAX_LINE_BYTES.

    The SDK (mcp/client/stdio.py) keeps a partial line without bound, and joins each piece read to
    all of it: a line of 20 MB took 2 s of the event loop that serves every session of the worker,
    and one without end took memory without end. Given whole lines, it never holds a partial one.
    A line past the bound ends the stream, as the server's exit would, once ``session`` was told;
    what follows is read only to be dropped (the SDK drains a server so that it can exit).
    """

    def __init__(self, stream: anyio.abc.ByteReceiveStream, session: "_Session | None") -> None:
        self._stream = stream
        self._session = session
        self._over = False
        self._partial: list[bytes] = []
        self._size = 0

    async def receive(self, max_bytes: int = 65536) -> bytes:
        if self._over:
            return await self._stream.receive(max_bytes)
        while True:
            data = await self._stream.receive(max_bytes)
            end = data.rfind(b"\n") + 1
            if end:
                lines = b"".join([*self._partial, data[:end]])
                self._partial, self._size = [data[end:]], len(data) - end
                if self._session is not None:
                    self._session.read_bytes += len(lines)
                return lines
            self._partial.append(data)
            self._size += len(data)
            if self._size > MAX_LINE_BYTES:
                self._over, self._partial = True, []
                if self._session is not None:
                    self._session.too_long("a line")
                raise anyio.EndOfStream

    async def aclose(self) -> None:
        await self._stream.aclose()


class _LinesProcess(anyio.abc.Process):
    """A stdio server's process as anyio's, its stdout read through ``_Lines``."""

    def __init__(self, process: anyio.abc.Process, session: "_Session | None") -> None:
        self._inner = process
        self._lines = _Lines(process.stdout, session) if process.stdout is not None else None

    def __getattr__(self, name: str) -> Any:
        # The SDK reaches into anyio's process for asyncio's transport, to close it (_process).
        if name == "_inner":  # not set yet: no recursion
            raise AttributeError(name)
        return getattr(self._inner, name)

    async def aclose(self) -> None:
        await self._inner.aclose()

    async def wait(self) -> int:
        return await self._inner.wait()

    def terminate(self) -> None:
        self._inner.terminate()

    def kill(self) -> None:
        self._inner.kill()

    def send_signal(self, signal: Signals) -> None:
        self._inner.send_signal(signal)

    @property
    def pid(self) -> int:
        return self._inner.pid

    @property
    def returncode(self) -> int | None:
        return self._inner.returncode

    @property
    def stdin(self) -> anyio.abc.ByteSendStream | None:
        return self._inner.stdin

    @property
    def stdout(self) -> anyio.abc.ByteReceiveStream | None:
        return self._lines

    @property
    def stderr(self) -> anyio.abc.ByteReceiveStream | None:
        return self._inner.stderr


# Whom a stdio server's lines are counted to, and one past MAX_LINE_BYTES told to: the session starting it.
_lines_of: contextvars.ContextVar["_Session | None"] = contextvars.ContextVar("lines_of", default=None)


@functools.cache
def _stdio_lines_bounded() -> None:
    """Have the SDK's stdio client read every server's stdout through ``_Lines``.

    The SDK takes no stream of ours: it spawns the server and reads its stdout itself. Its spawn
    (a module function it calls by name) is wrapped, so that only the reading changes, not the
    protocol nor the shutdown sequence, which copying ``stdio_client`` would fork.
    """
    from mcp.client import stdio

    spawn = stdio._create_platform_compatible_process

    async def spawn_bounded(*args: Any, **kwargs: Any) -> Any:
        process = await spawn(*args, **kwargs)
        if not isinstance(process, anyio.abc.Process):  # the SDK's fallback for Windows, where this never runs
            return process
        return _LinesProcess(process, _lines_of.get())

    stdio._create_platform_compatible_process = spawn_bounded


async def _bounded_body(response: Any, *, session: "_Session") -> None:
    """Have ``response`` (httpx2's, the streamable HTTP transport's) read through ``_BoundedBody``:
    inflated here a piece at a time (httpx2 inflates a piece at a time too, but the SDK reads an
    answer of JSON whole, ``aread``, however far it inflates), an answer of JSON at most
    MAX_LINE_BYTES. An event stream's events are each held to it by the SDK."""
    chain = inflate.inflaters(response.headers.get_list("content-encoding", split_commas=True))
    if chain:
        del response.headers["content-encoding"]  # undone here; not by httpx2 again
    streamed = response.headers.get("content-type", "").lower().startswith("text/event-stream")
    response.stream = _bounded_body_class()(response.stream, chain, None if streamed else MAX_LINE_BYTES, session)


@functools.cache
def _bounded_body_class() -> type:
    import httpx2

    class _TooLong(httpx2.StreamError):
        """Raised where the SDK reads an answer of JSON, which it catches (a StreamError) and ends."""

    class _BoundedBody(httpx2.AsyncByteStream):
        def __init__(self, stream: Any, chain: list[inflate.Inflater], most: int | None, session: "_Session") -> None:
            self._stream, self._chain, self._most, self._session = stream, chain, most, session

        async def __aiter__(self) -> Any:
            size = 0
            async for chunk in self._stream:
                try:
                    for piece in inflate.inflated(chunk, self._chain):
                        size += len(piece)
                        self._session.read_bytes += len(piece)
                        if self._most is not None and size > self._most:
                            self._session.too_long("an answer")  # it says why, before the SDK says anything
                            raise _TooLong(f"the answer is over {self._most} bytes")
                        yield piece
                except inflate.DecodingError as exc:  # as httpx2 says it
                    raise httpx2.DecodingError(str(exc)) from None
                if self._chain and self._chain[0].eof:  # its end: what follows is dropped
                    return

        async def aclose(self) -> None:
            await self._stream.aclose()

    return _BoundedBody


# What the SDK says when the connection closed (mcp's jsonrpc_dispatcher): its code alone, -32000,
# is also JSON-RPC's first server-error code, which a server may answer a call with.
_SDK_CLOSED = "Connection closed"


class _Session:
    """One live connection to one server, opened and closed by its own owner task."""

    def __init__(self, server: Server, loop: asyncio.AbstractEventLoop) -> None:
        self.server = server
        self.loop = loop
        self.ready: asyncio.Future[Any] = loop.create_future()
        self.closing = asyncio.Event()
        self.session: Any = None
        self.broken: str | None = None
        self.last_used = time.monotonic()
        self.inflight: set[Any] = set()  # anyio cancel scopes of calls waiting on this session
        self.read_bytes = 0  # what the server sent, as read (inflated): a listing is held to MAX_LISTING_BYTES
        self.stderr: _StderrTail | None = None
        self._init_scope: Any = None
        self.task: asyncio.Task[None] = loop.create_task(self._own())

    def close(self) -> None:
        self.broken = self.broken or "closed"
        self.closing.set()

    async def _open(self, stack: contextlib.AsyncExitStack) -> tuple[Any, Any]:
        from mcp import StdioServerParameters, stdio_client
        from mcp.client.streamable_http import streamable_http_client
        from mcp.shared._httpx_utils import create_mcp_http_client

        if self.server.transport == "stdio":
            self.stderr = _StderrTail(self.loop, self.server.secrets)
            params = StdioServerParameters(command=self.server.command, args=list(self.server.args), env=dict(self.server.env))
            _stdio_lines_bounded()
            told = _lines_of.set(self)
            try:
                streams = await stack.enter_async_context(stdio_client(params, errlog=self.stderr.writer))
            finally:
                _lines_of.reset(told)
                self.stderr.spawned()
            return streams
        # Only the codings _bounded_body undoes are asked for (httpx2 would ask for br and zstd too,
        # were their packages installed).
        headers = {**dict(self.server.headers), "Accept-Encoding": inflate.ACCEPT_ENCODING}
        client = await stack.enter_async_context(create_mcp_http_client(headers=headers))
        client.event_hooks = {"response": [functools.partial(_bounded_body, session=self)]}
        # Each event held to the bound a stdio line is: the SDK's own (1 MiB) refused an answer
        # within a call's limit, whose output it holds twice.
        http = streamable_http_client(self.server.url, http_client=client, max_sse_event_size=MAX_LINE_BYTES)
        return await stack.enter_async_context(http)

    async def _on_message(self, message: Any) -> None:
        """The SDK hands us what it could not parse; the session can't be trusted after that."""
        if not isinstance(message, Exception):
            return
        logger.warning("mcp server sent an unparseable message; closing its session: %s", self.server.describe())
        self._break(f"the server sent something that is not MCP ({type(message).__name__})")

    def too_long(self, what: str) -> None:
        """The server sent ``what`` (a line, an answer) past MAX_LINE_BYTES: break the session."""
        logger.warning("mcp server sent %s over %d bytes; closing its session: %s", what, MAX_LINE_BYTES, self.server.describe())
        self._break(
            f"the server sent {what} of over {MAX_LINE_BYTES:,} bytes, more than any answer may be; its session was closed"
        )

    def _break(self, why: str) -> None:
        """End the session's start and its calls saying ``why``, and close it."""
        self.broken = why
        if self._init_scope is not None:
            self._init_scope.cancel()
        for scope in list(self.inflight):
            scope.cancel()
        self.closing.set()

    async def _own(self) -> None:
        try:
            async with contextlib.AsyncExitStack() as stack:
                read, write = await self._open(stack)
                client = _client_session_class()
                session = await stack.enter_async_context(client(read, write, message_handler=self._on_message))
                initialized = False
                with anyio.move_on_after(self.server.init_timeout) as scope:
                    self._init_scope = scope
                    await session.initialize()
                    initialized = True
                self._init_scope = None
                if not initialized:
                    # Said now: closing the stack waits for the server to exit (the SDK gives a
                    # stdio server 2 s to, before it terminates it), which the caller need not.
                    self.ready.set_exception(self._init_failure())
                    return
                self.session = session
                self.ready.set_result(self)
                await self.closing.wait()
        except BaseException as exc:
            if not self.ready.done():
                self.ready.set_exception(self._start_failure(exc))
            elif not self.closing.is_set():
                logger.warning("mcp session ended: %s: %s", self.server.describe(), type(_leaf(exc)).__name__)
        finally:
            self.broken = self.broken or "the session ended"
            if self.stderr is not None:
                self.stderr.close()

    def _init_failure(self) -> ToolFailure:
        if self.broken:
            return ToolFailure(
                "mcp_bad_response", f"the MCP server {self.server.describe()} answered initialize with garbage: {self.broken}"
            )
        return ToolFailure(
            "mcp_init_timeout",
            f"the MCP server {self.server.describe()} did not finish initializing within {self.server.init_timeout:g} s"
            + self._stderr_note(),
        )

    def _stderr_note(self) -> str:
        text = self.stderr.text().strip() if self.stderr is not None else ""
        return f"; its stderr ends: {_excerpt(text, self.server)}" if text else ""

    def _start_failure(self, exc: BaseException) -> ToolFailure:
        from mcp import MCPError

        leaf = _leaf(exc)
        if isinstance(leaf, ToolFailure):
            return leaf
        where = self.server.describe()
        if isinstance(leaf, OSError) and self.server.transport == "stdio":
            # Why, never the file it names (its str does): the command, or a path in it, is the
            # toolset's config, which no tenant reads; where the deployment keeps its servers.
            why = leaf.strerror or type(leaf).__name__
            if leaf.filename is not None:
                why = f"its command could not be run ({why}); an admin must check the toolset's command"
            return ToolFailure("mcp_start_failed", f"the MCP server {where} could not be started: {why}")
        if isinstance(leaf, MCPError) and self.server.transport == "stdio":
            return ToolFailure("mcp_start_failed", f"the MCP server {where} exited while starting" + self._stderr_note())
        if isinstance(leaf, asyncio.CancelledError):
            return ToolFailure("mcp_start_failed", f"the MCP server {where} was shut down while starting")
        return ToolFailure(
            "mcp_start_failed",
            f"could not connect to the MCP server {where}: {type(leaf).__name__}: {_excerpt(str(leaf), self.server)}",
        )

    async def call(self, name: str, arguments: dict[str, Any], timeout: float) -> Any:
        """Return the output of one ``tools/call``, or raise ToolFailure."""
        from mcp import MCPError
        from mcp_types import CONNECTION_CLOSED, REQUEST_TIMEOUT

        self.last_used = time.monotonic()
        where = f"MCP tool '{name}'"
        with anyio.CancelScope() as scope:
            self.inflight.add(scope)
            try:
                result = await self.session.call_tool(name, arguments, read_timeout_seconds=timeout)
            except MCPError as exc:
                if exc.error.code == REQUEST_TIMEOUT:
                    raise ToolFailure("mcp_timeout", f"{where} did not answer within {timeout:g} s") from None
                if exc.error.code == CONNECTION_CLOSED and exc.error.message == _SDK_CLOSED:
                    self.close()
                    raise ToolFailure("mcp_connection_lost", f"the connection to the server of {where} closed") from None
                raise ToolFailure("mcp_error", f"{where}: {_excerpt(exc.error.message, self.server)}") from None
            except (anyio.ClosedResourceError, anyio.BrokenResourceError, anyio.EndOfStream):
                self.close()
                raise ToolFailure("mcp_connection_lost", f"the connection to the server of {where} closed") from None
            except RuntimeError as exc:  # structured content that does not match the tool's output schema
                raise ToolFailure("mcp_invalid_output", _excerpt(str(exc), self.server)) from None
            except ValueError as exc:  # pydantic: a result that is not a CallToolResult
                self.close()
                raise ToolFailure(
                    "mcp_bad_response", f"{where} answered with something that is not MCP: {type(exc).__name__}"
                ) from None
            finally:
                self.inflight.discard(scope)
                self.last_used = time.monotonic()
        if scope.cancelled_caught:
            raise ToolFailure("mcp_bad_response", f"{where}: {self.broken or 'the session was closed'}")
        return result_output(result, where, self.server.secrets)


@functools.cache
def _client_session_class() -> type:
    """The SDK's ClientSession, its check of a tool's structured output against the output schema
    its server lists made as a call's arguments are checked (tools/arguments.py).

    The SDK checks it with jsonschema, whose ``pattern`` is Python's ``re``: a server's
    ``^(a+)+$`` against 40 a's and a ``!`` backtracks for days holding the GIL, and froze the whole
    tools worker. Here patterns are bounded, the check is within its time, and it runs off the
    event loop, which serves every session of the process."""
    import jsonschema
    from mcp import ClientSession

    class _Checked(ClientSession):
        _ptc_validators: dict[str, tuple[Any, Any]]

        async def validate_tool_result(self, name: str, result: Any) -> None:
            # As the SDK's (mcp/client/session.py): the schema the server listed for ``name``,
            # listed again if it is not known yet; the same RuntimeErrors, which ``call`` reads.
            if name not in self._tool_output_schemas:
                await self.list_tools()
            schema = self._tool_output_schemas.get(name)
            if schema is None:
                return
            if result.structured_content is None and "structured_content" not in result.model_fields_set:
                raise RuntimeError(f"Tool {name} has an output schema but did not return structured content")
            validators = self.__dict__.setdefault("_ptc_validators", {})
            known = validators.get(name)
            if known is None or known[0] is not schema:  # one per schema, as the SDK keeps its own
                try:
                    jsonschema.validators.validator_for(schema).check_schema(schema)
                except jsonschema.SchemaError as exc:
                    raise RuntimeError(f"Invalid schema for tool {name}: {exc.message}") from None
                known = validators[name] = (schema, arguments_validator(schema))
            try:
                error = await anyio.to_thread.run_sync(arguments_error, known[1], result.structured_content)
            except ToolFailure as failure:
                why = failure.message.replace("the tool's input schema", "its output schema").replace("the call was not run", "")
                raise RuntimeError(f"The output of tool {name} could not be checked: {why.rstrip('; ')}") from None
            if error is not None:
                raise RuntimeError(f"Invalid structured content returned by tool {name}: {error.message}")

    return _Checked


def result_output(result: Any, where: str, secrets: tuple[str, ...]) -> Any:
    """Return a CallToolResult as JSON, ``secrets`` redacted: structured content, else JSON text
    decoded, else the text.

    Raise ToolFailure ``mcp_tool_error`` for an ``isError`` result, with its text as the message
    (redacted before it is cut: an upstream's "401: bad token ..." quotes it).
    """
    texts = [block.text for block in result.content if getattr(block, "type", "") == "text"]
    if result.is_error:
        message = secrets_redact("\n".join(texts), secrets).strip()[:2000]
        raise ToolFailure("mcp_tool_error", message or f"{where} reported an error")
    return secrets_redact_value(_output(result, texts), secrets)


def _output(result: Any, texts: list[str]) -> Any:
    if result.structured_content is not None:
        return result.structured_content
    if len(texts) == len(result.content) == 1:
        text = texts[0]
        if text.lstrip()[:1] in ("{", "["):
            # Most servers return JSON as text; code is better served by the value than by the string.
            # A text that can't be decoded (not JSON, or nested too deep for the decoder) is the text.
            with contextlib.suppress(ValueError, RecursionError):
                return json.loads(text)
        return text
    if len(texts) == len(result.content):
        return "\n".join(texts)
    return [block.model_dump(mode="json", exclude_none=True) for block in result.content]


class _Pool:
    """The sessions of one process, on one event loop in a daemon thread. Started on first use."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._sessions: dict[str, _Session] = {}  # touched only on the loop's thread
        self._retired: set[asyncio.Task[None]] = set()
        self._reaper: asyncio.Task[None] | None = None

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None or self._thread is None or not self._thread.is_alive():
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=loop.run_forever, name="ptc-mcp", daemon=True)
                thread.start()
                self._loop, self._thread, self._sessions, self._reaper = loop, thread, {}, None
            return self._loop

    def run(self, make: Callable[[], Awaitable[T]], timeout: float, secrets: tuple[str, ...]) -> T:
        """Run a coroutine on the loop from any thread; give up after ``timeout`` seconds.

        Raise ToolFailure with ``secrets`` redacted from its message, whatever built it: the
        message goes to the sandbox, the call's record, its events and the logs.
        """
        future = asyncio.run_coroutine_threadsafe(_awaited(make), self._running_loop())
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise ToolFailure("mcp_timeout", f"no answer from the MCP server within {timeout:g} s") from None
        except ToolFailure as failure:
            raise ToolFailure(failure.code, secrets_redact(failure.message, secrets)) from None

    async def session(self, key: str, server: Server) -> _Session:
        """Return the live session for ``key``, opening one if there is none or its config changed."""
        if self._reaper is None:
            self._reaper = asyncio.get_running_loop().create_task(self._reap_idle())
        current = self._sessions.get(key)
        if current is None or current.broken or current.server.fingerprint != server.fingerprint:
            if current is not None:
                self._retire(current)
            current = self._sessions[key] = _Session(server, asyncio.get_running_loop())
        try:
            # Shielded: a caller that gives up must not cancel the start the other callers wait on.
            return await asyncio.shield(current.ready)
        except ToolFailure:
            if self._sessions.get(key) is current:
                del self._sessions[key]
            raise

    def _retire(self, session: _Session) -> None:
        session.close()
        self._retired.add(session.task)
        session.task.add_done_callback(self._retired.discard)

    async def _reap_idle(self) -> None:
        while True:
            await asyncio.sleep(_REAP_EVERY)
            now = time.monotonic()
            for key, session in list(self._sessions.items()):
                if session.ready.done() and not session.inflight and now - session.last_used > IDLE_SECONDS:
                    del self._sessions[key]
                    self._retire(session)

    async def _close_all(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        for session in self._sessions.values():
            self._retire(session)
        self._sessions.clear()
        tasks = list(self._retired)
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=_CLOSE_SECONDS)
            for task in pending:
                task.cancel()

    def close(self) -> None:
        """Close every session (stopping stdio servers) and stop the loop. Safe to call twice."""
        with self._lock:
            loop, thread = self._loop, self._thread
            self._loop = self._thread = None
        if loop is None or thread is None or not thread.is_alive():
            return
        try:
            asyncio.run_coroutine_threadsafe(self._close_all(), loop).result(_CLOSE_SECONDS + 5)
        except Exception:  # shutting down: log it, and still stop the loop
            logger.exception("closing MCP sessions failed")
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)


async def _awaited(make: Callable[[], Awaitable[T]]) -> T:
    return await make()


_pool = _Pool()
atexit.register(_pool.close)


def sessions_close() -> None:
    """Close every pooled session of this process. Called when the tools worker shuts down."""
    _pool.close()


def _key(toolset: Toolset) -> str:
    return str(toolset.pk)


def run(*, toolset: Toolset, tool: Tool, arguments: dict[str, Any], timeout: float) -> Any:
    """Call ``tool`` on its toolset's server, through this process's pooled session."""
    server = server_for(toolset)
    name = tool.remote_name or tool.name

    async def call() -> Any:
        session = await _pool.session(_key(toolset), server)
        return await session.call(name, arguments, timeout)

    return _pool.run(call, server.init_timeout + timeout + 5, server.secrets)


@dataclass(frozen=True)
class ListedTool:
    name: str
    description: str
    input_schema: dict[str, Any]
    output_schema: dict[str, Any] | None
    read_only: bool


def tools_list(*, toolset: Toolset) -> list[ListedTool]:
    """Return the server's tools, from a session opened for this and closed after (not pooled).
    Their descriptions and schemas come with the toolset's secrets redacted: they are shown to
    everyone the toolset is granted to, and a server may quote its own configuration."""
    server = server_for(toolset)

    async def listing() -> list[ListedTool]:
        session = _Session(server, asyncio.get_running_loop())
        try:
            await asyncio.shield(session.ready)
            found, cursor = [], None
            cursors: set[str] = set()
            while True:
                from mcp_types import PaginatedRequestParams

                with anyio.CancelScope() as scope:  # cancelled as a call's is, when the session breaks
                    session.inflight.add(scope)
                    try:
                        page = await session.session.list_tools(params=PaginatedRequestParams(cursor=cursor) if cursor else None)
                    finally:
                        session.inflight.discard(scope)
                if scope.cancelled_caught:
                    raise ToolFailure(
                        "mcp_bad_response", f"the MCP server {server.describe()} did not list its tools: {session.broken}"
                    )
                found += page.tools
                if session.read_bytes > MAX_LISTING_BYTES:
                    raise ToolFailure(
                        "mcp_bad_response",
                        f"the MCP server {server.describe()} lists over {MAX_LISTING_BYTES:,} bytes of tools"
                        f" (after {len(cursors) + 1} pages and {len(found)} tools), more than a listing may be",
                    )
                cursor = page.next_cursor
                if not cursor or len(found) > 10_000:
                    break
                # A page named again (or pages without end, each empty): the listing would go on
                # until its time is up, and then be said to have had no answer.
                if cursor in cursors or len(cursors) >= _MAX_PAGES:
                    raise ToolFailure(
                        "mcp_bad_response",
                        f"the MCP server {server.describe()} lists its tools in pages without end"
                        f" (after {len(cursors) + 1} pages and {len(found)} tools, it named the page"
                        f" {_excerpt(repr(cursor), server)} {'again' if cursor in cursors else 'next'})",
                    )
                cursors.add(cursor)
            return [
                ListedTool(
                    name=secrets_redact(t.name, server.secrets),  # one that held a secret is not synced
                    description=secrets_redact(t.description or "", server.secrets),
                    input_schema=secrets_redact_value(t.input_schema, server.secrets),
                    output_schema=secrets_redact_value(t.output_schema, server.secrets),
                    read_only=bool(t.annotations and t.annotations.read_only_hint),
                )
                for t in found
            ]
        finally:
            session.close()
            if session.session is not None:  # it started: it is shut down before the answer
                await asyncio.wait([session.task], timeout=_CLOSE_SECONDS)
            # One that never started is shut down by its own task, after the failure was said.

    return _pool.run(listing, server.init_timeout + 60, server.secrets)
