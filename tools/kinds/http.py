"""The ``http`` kind: one HTTP request per call, from the toolset's config and the tool's ``http`` spec.

Config: ``{"base_url", "headers": {name: value with {{secrets.NAME}}}, "timeout"}``.
Tool spec: ``{"method", "path": "/items/{id}", "query": ["limit"]}``. Arguments named by the path
fill it in; those named by ``query`` go in the query string; the rest go in the JSON body for POST,
PUT and PATCH, and in the query string for the other methods, which have no body.
"""

import ipaddress
import json
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import httpcore
import httpx
from django.conf import settings

from tools.errors import ToolFailure
from tools.kinds import inflate
from tools.models import Tool, Toolset
from tools.secret_refs import (
    MissingSecret,
    headers_ascii,
    headers_problem,
    secrets_reach,
    secrets_redact,
    secrets_redact_start,
    secrets_redact_value,
    secrets_render_map,
)

logger = logging.getLogger("ptc.tools")

METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE")
BODY_METHODS = ("POST", "PUT", "PATCH")
PATH_PARAM = re.compile(r"\{([^{}]*)\}")
EXCERPT_CHARS = 300
# An error's body is read this far, for its excerpt (a multi-byte text needs more bytes than characters).
EXCERPT_BYTES = 4 * EXCERPT_CHARS
# The most of a request's body sent in one go, each piece within what is left of its deadline.
_WRITE_PIECE = 64 << 10
# httpx's limit on a URL and on each of its parts (httpx._urlparse.MAX_URL_LENGTH).
MAX_URL_CHARS = 65536

# One client per tools-worker thread: connections to the same API are reused across calls, and no
# client is shared between threads.
_local = threading.local()


def _left(timeout: float | None, late: type[httpcore.TimeoutException]) -> float | None:
    """The timeout of one socket operation of this thread's request: ``timeout``, cut to what is left
    before the request's deadline. Raise ``late`` past the deadline."""
    deadline = getattr(_local, "deadline", None)
    if deadline is None:
        return timeout
    left = deadline - time.monotonic()
    if left <= 0:
        raise late("the request's time is up")
    return left if timeout is None else min(timeout, left)


class _DeadlineStream(httpcore.NetworkStream):
    """A connection whose every read and write ends by its thread's request's deadline."""

    def __init__(self, stream: httpcore.NetworkStream) -> None:
        self._stream = stream

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._stream.read(max_bytes, _left(timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        # httpcore sends a buffer in as many sends as it takes, each given the whole timeout: a
        # server that reads a large body slowly is held to the deadline a piece at a time.
        for start in range(0, len(buffer) or 1, _WRITE_PIECE):
            self._stream.write(buffer[start : start + _WRITE_PIECE], _left(timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self._stream.close()

    def start_tls(self, ssl_context: Any, server_hostname: str | None = None, timeout: float | None = None) -> "_DeadlineStream":
        return _DeadlineStream(self._stream.start_tls(ssl_context, server_hostname, _left(timeout, httpcore.ConnectTimeout)))

    def get_extra_info(self, info: str) -> Any:
        return self._stream.get_extra_info(info)


# A host's name is looked up on a thread of its own, so that its request waits for the answer no
# longer than its deadline: the system's resolver takes as long as its own timeouts say (5 s a try,
# and tries by name server), and ``getaddrinfo`` can't be told otherwise. A lookup past its
# request's deadline goes on, on its thread, while the request ends ``http_timeout``; no request
# ever waits for another's lookup. At most MAX_LOOKUPS go on at once in a process: past that, a
# request looks its name up on its own thread, as it did before (its deadline then waits for it).
MAX_LOOKUPS = 256
_lookups: tuple[int, threading.BoundedSemaphore] | None = None
_lookups_lock = threading.Lock()


def _lookup_places() -> threading.BoundedSemaphore:
    """This process's places for lookups (a forked child has none of its parent's threads)."""
    global _lookups
    with _lookups_lock:
        if _lookups is None or _lookups[0] != os.getpid():
            _lookups = (os.getpid(), threading.BoundedSemaphore(MAX_LOOKUPS))
        return _lookups[1]


def _addresses(host: str, port: int, timeout: float | None) -> list[str]:
    """The addresses of ``host`` (an address itself is its own), looked up within ``timeout``
    seconds (ConnectTimeout past it); ConnectError if it has none."""
    try:
        ipaddress.ip_address(host)
        return [host]
    except ValueError:
        pass
    places = _lookup_places()
    if not places.acquire(blocking=False):
        return _looked_up(host, port)
    found: dict[str, Any] = {}
    done = threading.Event()

    def look_up() -> None:
        try:
            found["addresses"] = _looked_up(host, port)
        except httpcore.ConnectError as exc:
            found["error"] = exc
        finally:
            places.release()
            done.set()

    threading.Thread(target=look_up, name="ptc-http-lookup", daemon=True).start()
    if not done.wait(timeout):
        raise httpcore.ConnectTimeout(f"looking up {host!r} took longer than the request may")
    if "error" in found:
        raise found["error"]
    return found["addresses"]


def _looked_up(host: str, port: int) -> list[str]:
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise httpcore.ConnectError(str(exc)) from exc
    return list(dict.fromkeys(str(info[4][0]) for info in found))


class _DeadlineBackend(httpcore.SyncBackend):
    """httpcore's sockets, each bounded by its thread's request's deadline (``_local.deadline``):
    httpx's timeouts bound each connect, read and write, so a server that sends a byte at a time
    would hold the thread for as long as it likes. The name's lookup is bounded too (``_addresses``);
    its addresses are tried in turn while one refuses, as ``socket.create_connection`` does."""

    def connect_tcp(self, host: str, port: int, timeout: float | None = None, *args: Any, **kwargs: Any) -> _DeadlineStream:
        failed: Exception | None = None
        for address in _addresses(host, port, _left(timeout, httpcore.ConnectTimeout)):
            try:
                stream = super().connect_tcp(address, port, _left(timeout, httpcore.ConnectTimeout), *args, **kwargs)
            except httpcore.ConnectError as exc:
                failed = exc
                continue
            return _DeadlineStream(stream)
        raise failed or httpcore.ConnectError(f"{host!r} has no address")


def _client() -> httpx.Client:
    client = getattr(_local, "client", None)
    if client is None:
        # Redirects are not followed: a redirect elsewhere would carry the secret headers with it.
        # Only the codings _body decodes are asked for: httpx would ask for br and zstd too, were their
        # packages installed.
        client = _local.client = httpx.Client(follow_redirects=False, headers={"Accept-Encoding": inflate.ACCEPT_ENCODING})
        # httpx takes no network backend: each connection pool it built, its own and one for each
        # proxy the environment names (HTTPS_PROXY, ...), is given the deadline's (httpcore opens
        # every connection through its pool's ``_network_backend``).
        for transport in [client._transport, *client._mounts.values()]:
            pool = getattr(transport, "_pool", None)
            if pool is not None:
                pool._network_backend = _DeadlineBackend()
    return client


def path_params(path: str) -> list[str]:
    """Return the ``{param}`` names in an HTTP spec's path, in order."""
    return PATH_PARAM.findall(path)


def _excerpt(text: str, secrets: list[str]) -> str:
    text = " ".join(secrets_redact(text, secrets).split())
    return text if len(text) <= EXCERPT_CHARS else text[:EXCERPT_CHARS] + "…"


def _scalar(value: Any) -> str:
    # What is not a string as JSON spells it: most HTTP APIs expect ``true``, not Python's ``True``,
    # and an object or a null in a list as JSON (``{"a": true}``, ``null``), never Python's repr.
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def request_parts(spec: dict[str, Any], arguments: dict[str, Any]) -> tuple[str, str, dict[str, Any], Any]:
    """Return ``(method, path, query, json_body)`` for a call. Raise ToolFailure for a missing path argument."""
    method = str(spec.get("method", "GET")).upper()
    template = str(spec.get("path", "/"))
    used = set()

    def fill(match: re.Match[str]) -> str:
        name = match.group(1)
        if arguments.get(name) is None:
            raise ToolFailure("invalid_arguments", f"'{name}' is required: the request path needs it")
        used.add(name)
        value = _scalar(arguments[name])
        # A dot segment: the URL would resolve it to another path. An empty one makes ``//``, which
        # servers collapse (``/items//owner`` is ``/items/owner``) or end the path with (``/items/``:
        # the collection, not one of its items).
        if value in ("", ".", ".."):
            raise ToolFailure("invalid_arguments", f"'{name}' can't be {value!r}: in the request path it would name another path")
        return quote(value, safe="")

    path = PATH_PARAM.sub(fill, template)
    query_names = set(spec.get("query") or [])
    rest = {k: v for k, v in arguments.items() if k not in used and k not in query_names}
    query = {k: v for k, v in arguments.items() if k in query_names and v is not None}
    body = None
    if method in BODY_METHODS:
        body = rest
    else:
        query.update({k: v for k, v in rest.items() if v is not None})
    query = {k: [_scalar(x) for x in v] if isinstance(v, list) else _scalar(v) for k, v in query.items()}
    return method, path, query, body


def run(*, toolset: Toolset, tool: Tool, arguments: dict[str, Any], timeout: float) -> Any:
    """Send the request and return the decoded JSON body (None when it is empty), secrets redacted.

    Raise ToolFailure: ``http_error`` for a non-2xx status, ``http_timeout``, ``http_connection_error``,
    ``http_invalid_json`` for a body that is not JSON, ``http_config_invalid`` for a header that is not
    ASCII, ``invalid_arguments`` for a URL httpx refuses. Each message names the status and quotes the
    start of the body, with the toolset's secret values redacted.
    """
    config = toolset.config or {}
    secrets = [str(v) for v in (toolset.secrets or {}).values()]
    spec = tool.http or {}
    method, path, query, body = request_parts(spec, arguments)
    try:
        headers = secrets_render_map(config.get("headers"), toolset.secrets or {})
    except MissingSecret as missing:
        raise ToolFailure(
            "secret_missing", f"the toolset's headers use the secret '{missing.name}', which is not set; an admin must set it"
        ) from None
    # Refused as the toolset is written; a row written before: httpx's error would quote the character.
    # The rendered headers are checked first, cheaply, on every call; the templates only to say why.
    if not headers_ascii(headers) and (problem := headers_problem(config.get("headers"), toolset.secrets or {})):
        raise ToolFailure(
            "http_config_invalid", f"the toolset's header {problem}; an admin must change it (encoded as its API says)"
        )
    # A toolset-wide timeout applies when the tool sets none; the bridge never waits longer than ``timeout``.
    limit = tool.timeout or min(float(config.get("timeout") or timeout), timeout)
    # Every message names the request: its path as the arguments filled it in, cut as an excerpt
    # is (an id of 60,000 characters still makes a URL httpx sends, and was quoted whole).
    where = f"{method} {path if len(path) <= EXCERPT_CHARS else path[:EXCERPT_CHARS] + '…'}"
    try:
        url = httpx.URL(str(config.get("base_url", "")).rstrip("/") + "/" + path.lstrip("/")).copy_merge_params(query)
    except httpx.InvalidURL as exc:  # not an httpx.HTTPError: raised before any request
        # The arguments (the base_url was checked when the toolset was written); the path as the
        # tool names it, not as they fill it in.
        raise ToolFailure(
            "invalid_arguments",
            f"{method} {spec.get('path', '/')} can't be sent with these arguments: {_excerpt(str(exc), secrets)}"
            f" (httpx refuses the URL they make; a URL, and each of its parts, is at most {MAX_URL_CHARS:,} characters)",
        ) from None
    most = settings.PTC_MAX_TOOL_OUTPUT_BYTES
    response = None
    # The whole request, from connect to the body's last byte, within ``limit`` (_DeadlineBackend).
    _local.deadline = time.monotonic() + limit
    try:
        with _client().stream(
            method, url, json=body, headers={"Accept": "application/json", **headers}, timeout=limit
        ) as response:
            # Read no more than a result may be (an error's body, no more than its excerpt needs):
            # a server's 300 MB answer is not held in the worker's memory, every call's worker.
            text, whole = _body(response, most if response.is_success else EXCERPT_BYTES + secrets_reach(secrets))
    except httpx.TimeoutException:
        # Leaving the ``with`` closed the connection: one cut mid-answer is never reused.
        if response is None:
            raise ToolFailure("http_timeout", f"{where} got no answer within {limit:g} s") from None
        raise ToolFailure(
            "http_timeout", f"{where} answered HTTP {response.status_code} but did not send all its body within {limit:g} s"
        ) from None
    except httpx.HTTPError as exc:
        message = _excerpt(f"{type(exc).__name__}: {exc}", secrets)
        if response is not None:  # it answered: a body cut short, or not in the encoding it said
            answered = f"{where} answered HTTP {response.status_code}"
            raise ToolFailure("http_connection_error", f"{answered} but its answer could not be read: {message}") from None
        raise ToolFailure("http_connection_error", f"{where} could not reach the server: {message}") from None
    finally:
        _local.deadline = None
    if response.is_success and not whole:
        raise ToolFailure("output_too_large", f"{where} answered over {most} bytes; the limit is {most}")
    if not response.is_success:
        if not whole:  # redacted before it is cut for the excerpt: a secret cut off would show its start
            text = secrets_redact_start(text, secrets)
        # The status line is the server's too: a reason phrase may echo a header back.
        # A redirect's body is usually empty: where it points is what says something.
        said = (
            f"a redirect to {response.headers['location']}, not followed (point the toolset's base_url there)"
            if response.is_redirect
            else text
        )
        answered = _excerpt(f"HTTP {response.status_code} {response.reason_phrase}: {said}", secrets)
        raise ToolFailure("http_error", f"{where} answered {answered}")
    if not text.strip():
        return None
    try:
        output = json.loads(text)
    except (ValueError, RecursionError) as exc:
        kind = response.headers.get("content-type", "no content type").split(";")[0]
        if isinstance(exc, RecursionError):
            why = "JSON nested too deep"
        elif not isinstance(exc, json.JSONDecodeError):  # JSON, but an integer past Python's 4,300 digits
            why = "JSON holding a number too long to read"
        else:
            why = f"{kind}, not JSON"
        raise ToolFailure(
            "http_invalid_json", f"{where} answered HTTP {response.status_code} with {why}: {_excerpt(text, secrets)}"
        ) from None
    # An API that echoes a header back must not carry the secret into the sandbox.
    return secrets_redact_value(output, secrets)


def _body(response: httpx.Response, most: int) -> tuple[str, bool]:
    """Return the response's body as text, read up to ``most`` bytes (decompressed), and whether
    that is all of it. Raise ``httpx.DecodingError`` for a body not in the coding it says."""
    chain = inflate.inflaters(response.headers.get_list("content-encoding", split_commas=True))
    read = bytearray()
    try:
        for piece in _decoded(response, chain):
            read += piece
            if len(read) > most:
                break
    except inflate.DecodingError as exc:  # as httpx says it
        raise httpx.DecodingError(str(exc)) from None
    whole = len(read) <= most
    try:
        return read[:most].decode(response.encoding or "utf-8", errors="replace"), whole
    except LookupError:
        # A charset naming a codec that is no text encoding (rot13, base64: httpx takes any codec
        # Python knows). As for a charset httpx does not know, the body is read as UTF-8.
        return read[:most].decode("utf-8", errors="replace"), whole


def _decoded(response: httpx.Response, chain: list[inflate.Inflater]) -> Iterator[bytes]:
    # Read raw and inflated here, a piece at a time: httpx inflates each piece as it came whole.
    for chunk in response.iter_raw():
        yield from inflate.inflated(chunk, chain)
        if chain and chain[0].eof:  # its end: httpx read on, and kept what followed in zlib's unused_data
            return
