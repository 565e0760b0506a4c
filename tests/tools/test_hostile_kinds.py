"""Hostile upstreams and arguments against the tool kinds, end to end: a job's code calls a local
HTTP API (served from a thread of the test process) through the real tools worker. Whatever the
upstream does, the call ends with a stable code and a readable message, its record is whole, no
secret shows, and the worker serves the next call."""

import functools
import json
import re
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, quote, urlsplit

import pytest
from django.conf import settings

from tests.conftest import Api
from tests.stack import ARTIFACTS, Stack, peak_mb, peak_reset
from tests.tools.conftest import HERE, mcp_stdio_config, unique_key
from tools.sdk import class_name

# A secret as many APIs issue them: base64, with the characters a URL or a JSON encoder escapes.
SECRET = f"sk+{uuid.uuid4().hex[:12]}/{uuid.uuid4().hex[:12]}=="


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # quiet test output
        pass

    def _send(self, status: int, body: bytes, content_type: str = "application/json", **headers: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in headers.items():
            self.send_header(name.replace("_", "-"), value)
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        route = urlsplit(self.path).path.strip("/").split("/")[0]
        key = self.headers.get("X-Key", "")
        if route == "ok":
            self._send(200, b'{"ok": true}')
        elif route == "items":  # the collection, or one item: which the server was asked for
            self._send(200, json.dumps({"path": urlsplit(self.path).path}).encode())
        elif route == "query":  # the query string as it came
            self._send(200, json.dumps(parse_qs(urlsplit(self.path).query)).encode())
        elif route == "cut":  # an answer that ends before the length it gave
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", "100")
            self.end_headers()
            self.wfile.write(b'{"a"')
            self.close_connection = True
        elif route == "gzip":  # said to be gzip, and not
            self._send(200, b'{"ok": true}', Content_Encoding="gzip")
        elif route == "bomb":  # far more than a call may answer, compressed as ``enc`` says
            query = parse_qs(urlsplit(self.path).query)
            encoding = query.get("enc", ["gzip"])[0]
            self._send(int(query.get("status", ["200"])[0]), _bomb(encoding), Content_Encoding=encoding)
        elif route == "onion":  # JSON gzipped 2,000 times over, as its header says
            self._send(200, _onion(), Content_Encoding=", ".join(["gzip"] * 2000))
        elif route == "zipped":  # an answer as most APIs compress theirs; deflate without zlib's header, as some do
            encoding = parse_qs(urlsplit(self.path).query).get("enc", ["gzip"])[0]
            body = zlib.compress(b'{"ok": true}', wbits=WBITS[encoding] if encoding == "gzip" else -zlib.MAX_WBITS)
            self._send(200, body, Content_Encoding=encoding)
        elif route == "bigint":  # JSON, with a number of 5,000 digits (Python reads at most 4,300)
            self._send(200, b'{"n": ' + b"1" * 5000 + b"}")
        elif route == "codec":  # a charset that names a codec, but not a text encoding
            self._send(200, b'{"ok": true}', "application/json; charset=rot13")
        elif route == "codec_error":
            self._send(500, b"internal error", "text/plain; charset=base64")
        elif route == "login":  # a redirect to a login page, the key it was sent URL-encoded in its query
            self._send(302, b"", Location=f"https://login.example/?next=/api&key={quote(key, safe='')}")
        elif route == "php":  # an error body as PHP's json_encode writes it: "/" escaped as "\/"
            self._send(401, json.dumps({"error": "bad key", "key": key}).replace("/", "\\/").encode())
        else:
            self._send(404, b'{"error": "no such route"}')

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.do_GET()


# Content-Encoding's names, as zlib's ``wbits``.
WBITS = {"gzip": zlib.MAX_WBITS | 16, "deflate": zlib.MAX_WBITS}


@functools.cache
def _bomb(encoding: str) -> bytes:
    """200 MiB of ``x``, compressed by each of ``encoding``'s codings in turn (``deflate, gzip``:
    deflated, then that gzipped). One coding makes it 200 KiB; two, a few hundred bytes."""
    codings = [name.strip() for name in encoding.split(",")]
    first = zlib.compressobj(wbits=WBITS[codings[0]])
    mib = b"x" * (1 << 20)
    body = b"".join(first.compress(mib) for _ in range(200)) + first.flush()
    for name in codings[1:]:
        body = zlib.compress(body, wbits=WBITS[name])
    return body


class _McpHandler(BaseHTTPRequestHandler):
    """An MCP server over streamable HTTP, as little of one as a client needs: each answer JSON, no
    event stream. A call of ``huge`` answers a text of 64 MiB, sent as 64 KiB of gzip; any other
    tool's, the text ``plain``."""

    def log_message(self, format: str, *args: Any) -> None:  # quiet test output
        pass

    def _send(self, status: int, body: bytes = b"", **headers: str) -> None:
        self.send_response(status)
        for name, value in {"Content-Type": "application/json", "Mcp-Session-Id": "one", **headers}.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # no event stream for the server's own messages
        self._send(405)

    def do_DELETE(self) -> None:
        self._send(200)

    def do_POST(self) -> None:
        message = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if "id" not in message:  # a notification
            return self._send(202)
        answer = {"jsonrpc": "2.0", "id": message["id"], "result": {}}
        if message["method"] == "initialize":
            info = {"name": "hostile-http", "version": "1"}
            answer["result"] = {
                "protocolVersion": message["params"]["protocolVersion"],
                "capabilities": {"tools": {}},
                "serverInfo": info,
            }
        elif message["method"] == "tools/list":
            answer["result"] = {"tools": [{"name": n, "inputSchema": {"type": "object"}} for n in ("huge", "plain")]}
        elif message["method"] == "tools/call" and message["params"]["name"] == "huge":
            head, tail = json.dumps({**answer, "result": {"content": [{"type": "text", "text": "@"}]}}).encode().split(b"@")
            gzip = zlib.compressobj(wbits=WBITS["gzip"])
            mib = b"x" * (1 << 20)
            body = gzip.compress(head) + b"".join(gzip.compress(mib) for _ in range(64)) + gzip.compress(tail) + gzip.flush()
            return self._send(200, body, **{"Content-Encoding": "gzip"})
        elif message["method"] == "tools/call":
            answer["result"] = {"content": [{"type": "text", "text": "plain"}]}
        self._send(200, json.dumps(answer).encode())


@functools.cache
def _onion() -> bytes:
    body = b'{"ok": true}'
    for _ in range(2000):
        body = zlib.compress(body, wbits=WBITS["gzip"])
    return body


def _served(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """Serve ``handler`` on a loopback port until the generator is closed; yield its base URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def mcp_upstream() -> Iterator[str]:
    for url in _served(_McpHandler):
        yield f"{url}/mcp"


@pytest.fixture(scope="module")
def upstream() -> Iterator[str]:
    yield from _served(_Handler)


def _get(name: str, path: str, method: str = "GET", **properties: Any) -> dict[str, Any]:
    schema = {"type": "object", "properties": properties, "required": [p for p in properties if "{" + p + "}" in path]}
    return {"name": name, "input_schema": schema, "http": {"method": method, "path": path, "query": []}}


# A schema of 30 definitions, each "any of the next, or the next": 2**30 ways to a value it refuses.
DOUBLING = {f"d{i}": {"anyOf": [{"$ref": f"#/$defs/d{i + 1}"}] * 2} for i in range(30)} | {"d30": {"type": "integer"}}


EITHER = _get("either", "/ok", x={"$ref": "#/$defs/d0"})
EITHER["input_schema"]["$defs"] = DOUBLING


@pytest.fixture
def hostile(upstream: str, create_toolset: Callable[..., dict[str, Any]]) -> str:
    key = unique_key("hostile")
    create_toolset(
        {
            "key": key,
            "name": "Hostile",
            "kind": "http",
            "config": {"base_url": upstream, "headers": {"X-Key": "{{secrets.K}}"}, "timeout": 5},
            "secrets": {"K": SECRET},
            "tools": [
                _get("ok", "/ok"),
                _get("codec", "/codec"),
                _get("codec_error", "/codec_error"),
                _get("login", "/login"),
                _get("php", "/php"),
                _get("item", "/missing/{id}", id={"type": "string"}),
                _get("item_of", "/items/{id}/owner", id={"type": "string"}),
                _get("search", "/query", where={"type": "object"}, ids={"type": "array"}),
                _get("pick", "/ok", "POST", picks={"type": "array", "items": {"enum": [f"v{i}" for i in range(5000)]}}),
                _get("spell", "/ok", "POST", words={"type": "array", "items": {"type": "string", "pattern": "^(a|aa)+$"}}),
                # Items that must NOT match: each refused match passes, so every item is matched.
                _get("misspell", "/ok", "POST", words={"type": "array", "items": {"not": {"pattern": "^(a|aa)+$"}}}),
                _get("bigint", "/bigint"),
                _get("cut", "/cut"),
                _get("gzip", "/gzip"),
                _get("zipped", "/zipped", enc={"type": "string"}),
                _get("onion", "/onion"),
                _get("bomb", "/bomb", enc={"type": "string"}, status={"type": "integer"}),
                EITHER,
                _get("pattern", "/ok", r={"type": "string", "format": "regex"}),
                _get("half", "/ok", n={"type": "number", "multipleOf": 0.5}),
                _get("tags", "/ok", "POST", tags={"type": "array", "uniqueItems": True}),
            ],
        }
    )
    return key


def _calls(api: Api, key: str, calls: str) -> tuple[dict[str, Any], list[str]]:
    """Run ``calls`` (one expression a line, on ``T``) in a job, each caught; return the job and
    a ``code | message`` line (or the result) a call."""
    lines = "\n".join(f"    lambda: {call}," for call in calls.strip().splitlines())
    code = f"""
from ptc_tools import ToolError
from ptc_tools.{key} import {class_name(key)} as T
for call in (
{lines}
):
    try:
        print("ok |", call())
    except ToolError as e:
        print(e.code, "|", e.message)
"""
    job = api.run(code, toolsets=[key])
    assert job["status"] == "completed", job["error"]
    return job, job["stdout"].splitlines()


def _whole(job: dict[str, Any]) -> None:
    """Every call of the job ended, as the record says."""
    assert all(c["status"] in ("completed", "failed") for c in job["tool_calls"]), job["tool_calls"]


def test_a_charset_that_is_not_a_text_encoding_is_read_as_utf8(api: Api, hostile: str) -> None:
    """``charset=rot13`` (or base64) names a codec Python knows, but not one bytes decode with: the
    body is read as UTF-8, as one in a charset nobody knows is, not a crash of the call
    (``internal_error``); the worker's next call runs."""
    job, lines = _calls(api, hostile, "T.codec()\nT.codec_error()\nT.ok()")
    codec, codec_error, ok = lines
    assert codec == "ok | {'ok': True}", codec
    assert codec_error == "http_error | GET /codec_error answered HTTP 500 Internal Server Error: internal error", codec_error
    assert ok == "ok | {'ok': True}"
    _whole(job)


def test_a_secret_the_upstream_echoes_escaped_is_redacted(api: Api, hostile: str) -> None:
    """A key of base64 echoed back URL-encoded (a redirect's Location) or with its "/" escaped (PHP's
    JSON): either form of it is the secret."""
    job, lines = _calls(api, hostile, "T.login()\nT.php()")
    login, php = lines
    assert login.startswith("http_error | GET /login answered HTTP 302 Found: a redirect to https://login.example/"), login
    assert "key=[redacted]" in login, login
    assert php.startswith("http_error | GET /php answered HTTP 401 Unauthorized:") and "[redacted]" in php, php
    text = json.dumps(job)
    for form in (SECRET, quote(SECRET, safe=""), SECRET.replace("/", "\\/"), SECRET[3:15]):
        assert form not in text, form
    assert SECRET[3:15] not in (ARTIFACTS / "tools-worker.log").read_text(errors="replace")


def test_an_error_quotes_a_long_path_argument_cut(api: Api, hostile: str) -> None:
    """A 60,000-character id (a URL httpx still sends): the 404's message names the request by the
    tool's path, as its template says, not the 60 KB the arguments made of it."""
    job, lines = _calls(api, hostile, 'T.item(id="a" * 60000)\nT.ok()')
    missing, ok = lines
    assert missing.startswith("http_error | GET /missing/"), missing[:200]
    assert len(missing) < 1000, len(missing)
    assert ok == "ok | {'ok': True}"
    assert all(len(c["error"]["message"]) < 1000 for c in job["tool_calls"] if c["error"])


def test_arguments_a_schemas_checks_overflow_on_are_invalid_arguments(api: Api, hostile: str) -> None:
    """A schema's ``format: regex`` compiles the argument (``a{99999999999}`` overflows re's repeat
    count) and its ``multipleOf: 0.5`` divides by a float (10**400 overflows one): arguments it can't
    check are the call's invalid_arguments, checked before the call runs, not the job's bridge
    failing; the next call runs."""
    job, lines = _calls(api, hostile, 'T.pattern(r="a{99999999999}")\nT.half(n=10**400)\nT.half(n=1.5)')
    pattern, half, ok = lines
    assert pattern.startswith("invalid_arguments | the arguments can't be checked"), pattern
    assert "the repetition number is too large" in pattern, pattern
    assert half.startswith("invalid_arguments | the arguments can't be checked"), half
    assert ok == "ok | {'ok': True}"
    # Each call has its record (the two refused had none: "the call could not be recorded").
    codes = [(c["error"] or {}).get("code") for c in job["tool_calls"]]
    assert codes == ["invalid_arguments", "invalid_arguments", None], job["tool_calls"]
    _whole(job)


def test_unique_items_are_checked_in_linear_time() -> None:
    """The rule, as JSON Schema has it: 1 and 1.0 are equal, true and 1 are not, objects by value."""
    from tools.arguments import arguments_error, arguments_validator

    validator = arguments_validator({"type": "object", "properties": {"l": {"type": "array", "uniqueItems": True}}})
    for same in ([1, 1.0], [{"a": [1, {"b": None}]}, {"a": [1.0, {"b": None}]}], ["x", "x"], [[True], [True]]):
        assert arguments_error(validator, {"l": same}) is not None, same
    for different in ([1, True], [0, False], [[1], [True]], [{"a": 1}, {"a": 1, "b": 1}], ["1", 1], [None, False], [[], {}]):
        assert arguments_error(validator, {"l": different}) is None, different


def _counting(kind: type) -> Any:
    """A subclass of ``kind`` (int, str) whose values count the equality comparisons made with them,
    in ``made``: a dict's or a set's lookup makes one with each key that shares its hash, and
    jsonschema's enum one with each allowed value. A count, where a time is what load makes it."""

    class Counted(kind):
        made = 0

        def __eq__(self, other: object) -> bool:
            type(self).made += 1
            return kind.__eq__(self, other)

        __hash__ = kind.__hash__

    return Counted


def test_numbers_chosen_to_share_a_hash_are_checked_for_unique_items_and_enum_in_time() -> None:
    """Python hashes an int as its value mod 2**61 - 1: 20,000 multiples of that (500 KB, under a
    call's limit) all shared one, so each item keyed was compared with every one before it, 200
    million comparisons (2.8 s, 11 s at a call's limit), past the check's bound, as no keyword began.
    Counted on 2,000 of them: no more comparisons than numbers (before: 2 million and more)."""
    from tools.arguments import arguments_error, arguments_validator

    counted = _counting(int)
    shared = [counted(k * (2**61 - 1)) for k in range(1, 2_001)]
    unique = arguments_validator({"type": "object", "properties": {"l": {"type": "array", "uniqueItems": True}}})
    allowed = arguments_validator({"type": "object", "properties": {"l": {"items": {"enum": shared}}}})
    assert arguments_error(unique, {"l": shared}) is None
    assert arguments_error(allowed, {"l": shared}) is None
    assert counted.made <= len(shared), counted.made
    for same in ([-0.0, 0], [0.5, 0.5], [10**20, 1e20]):
        assert arguments_error(unique, {"l": same}) is not None, same


def test_a_long_list_of_objects_is_checked_for_unique_items_in_time(api: Api, hostile: str) -> None:
    """``uniqueItems`` on a list of 12,000 distinct objects (200 KB, well under a call's limit):
    jsonschema compares objects pairwise, 72 million comparisons, minutes of the exec worker's
    CPU for one call. The check takes as long as reading the list; a repeat is still found."""
    code = f"""
import time
from ptc_tools import ToolError
from ptc_tools.{hostile} import {class_name(hostile)} as T
tags = [{{"n": i}} for i in range(12000)]
started = time.monotonic()
print(T.tags(tags=tags), round(time.monotonic() - started, 1))
try:
    T.tags(tags=tags + [{{"n": 5.0}}])
except ToolError as e:
    print(e.code, "|", e.message[:200], "|", len(e.message))
"""
    job = api.run(code, toolsets=[hostile])
    assert job["status"] == "completed", job["error"]["message"][:300]
    ok, repeated = job["stdout"].splitlines()
    assert ok.startswith("{'ok': True} ") and float(ok.split()[-1]) < 5, ok
    assert repeated.startswith("invalid_arguments | tags: "), repeated
    assert "has non-unique elements" in repeated and int(repeated.split(" | ")[-1]) < 1000, repeated


def test_a_refused_call_quotes_what_the_code_sent_cut(api: Api, hostile: str) -> None:
    """A 300 KB list where a number goes, a 100,000-character toolset or tool name: each call is
    refused saying why, quoting no more of what the code sent than an excerpt (it went whole into
    the code's ToolError, the call's record and its events)."""
    code = f"""
from ptc_tools import ToolError, _runtime
from ptc_tools.{hostile} import {class_name(hostile)} as T
for call in (
    lambda: T.half(n=["x" * 1000] * 300),
    lambda: _runtime.call("t" * 100_000, "ok", {{}}),
    lambda: _runtime.call("{hostile}", "o" * 100_000, {{}}),
    lambda: T.ok(),
):
    try:
        print("ok |", call())
    except ToolError as e:
        print(e.code, "|", e.message[:60], "|", e.message[-40:], "|", len(e.message))
"""
    job = api.run(code, toolsets=[hostile])
    assert job["status"] == "completed", job["error"]
    wrong, toolset, tool, ok = job["stdout"].splitlines()
    assert wrong.startswith("invalid_arguments | n: ['xxx") and "is not of type 'number' |" in wrong, wrong
    assert toolset.startswith("unknown_toolset | there is no toolset 'ttt"), toolset
    assert tool.startswith(f"unknown_tool | toolset '{hostile}' has no tool 'ooo"), tool
    assert ok == "ok | {'ok': True}"
    assert all(int(line.split(" | ")[-1]) < 1000 for line in (wrong, toolset, tool)), (wrong, toolset, tool)
    assert all(len(c["error"]["message"]) < 1000 for c in job["tool_calls"] if c["error"])


def test_an_empty_path_argument_is_refused_as_a_dot_segment_is(api: Api, hostile: str) -> None:
    """``/items/{id}/owner`` with ``id=""`` is ``/items//owner``, which servers read as
    ``/items/owner`` (or ``/items/`` for ``/items/{id}``: the collection, not an item): another
    path, as ``..`` would name; refused before the request, and a real id still goes."""
    job, lines = _calls(api, hostile, 'T.item_of(id="")\nT.item_of(id="7")')
    empty, seven = lines
    assert [c["status"] for c in job["tool_calls"]] == ["failed", "completed"]
    assert empty == "invalid_arguments | 'id' can't be '': in the request path it would name another path", empty
    assert seven == "ok | {'path': '/items/7/owner'}", seven


def test_objects_and_nulls_in_a_query_are_sent_as_json(api: Api, hostile: str) -> None:
    """A query argument that is an object, or a list holding a null or a list: the server gets it as
    JSON, as it gets a boolean (``true``), never as Python writes it (``{'a': True}``, ``None``)."""
    _, lines = _calls(api, hostile, 'T.search(where={"city": "Oslo", "open": True}, ids=[1, None, [2, False]])')
    [sent] = lines
    assert eval(sent.removeprefix("ok | ")) == {"where": ['{"city": "Oslo", "open": true}'], "ids": ["1", "null", "[2, false]"]}


def test_enum_values_are_matched_as_json_schema_has_it() -> None:
    from tools.arguments import arguments_error, arguments_validator

    allowed = [1, "a", None, {"k": [1, {"b": False}]}, [True]]
    validator = arguments_validator({"type": "object", "properties": {"v": {"enum": allowed}}})
    for value in (1.0, "a", None, {"k": [1.0, {"b": False}]}, [True]):
        assert arguments_error(validator, {"v": value}) is None, value
    for value in (True, "A", False, {"k": [1, {"b": 0}]}, [1], {}):
        error = arguments_error(validator, {"v": value})
        assert error is not None and error.message == f"{value!r} is not one of {allowed!r}", value


def _calls_with(api: Api, hostile: str, tool: str, argument: str, *values: str) -> list[list[str]]:
    """Call the hostile toolset's ``tool`` once with each of ``values`` (Python expressions) as its
    ``argument``, from one job; return each call's ``[outcome, what it said]``: ``ok`` and its
    result, or the refusal's code and message."""
    code = f"""
from ptc_tools import ToolError
from ptc_tools.{hostile} import {class_name(hostile)} as T
for value in ({", ".join(values)},):
    try:
        print("ok |", T.{tool}({argument}=value))
    except ToolError as e:
        print(e.code, "|", e.message)
"""
    job = api.run(code, toolsets=[hostile])
    assert job["status"] == "completed", job["error"]
    return [line.split(" | ") for line in job["stdout"].splitlines()]


def test_a_long_list_is_checked_against_a_large_enum_in_time(api: Api, hostile: str) -> None:
    """Each item of a list against an enum of 5,000 values: jsonschema compared an item with each
    value in turn, and worded each miss with the whole enum's repr (40 KB): 100,000 items (800 KB,
    under a call's limit) were half a billion comparisons on the exec worker's bridge, and 10,000
    (here) are past the check's 2 s bound (the call refused "took over 2 s"), where a lookup each
    takes a hundredth of it. A miss is still found, and said with the first of the values. Counted:
    an item is compared with the value it equals, not with each (before: 5,000 each)."""
    from tools.arguments import arguments_error, arguments_validator

    ok, nope = _calls_with(api, hostile, "pick", "picks", '["v4999"] * 10_000', '["v1"] * 5_000 + ["nope"] * 5_000')
    assert ok == ["ok", "{'ok': True}"], ok
    assert nope[0] == "invalid_arguments", nope
    assert re.fullmatch(r"picks/\d+: 'nope' is not one of the 5000 values allowed: \['v0', 'v1', .*, \.\.\.\]", nope[1]), nope
    counted = _counting(str)
    values = [counted(f"v{i}") for i in range(5000)]
    picks = [counted("v4999") for _ in range(1000)]
    validator = arguments_validator({"type": "object", "properties": {"picks": {"type": "array", "items": {"enum": values}}}})
    assert arguments_error(validator, {"picks": picks}) is None
    assert counted.made <= 2 * len(picks), counted.made


def test_patterns_are_bounded_over_a_whole_call_not_only_each_match(api: Api, hostile: str) -> None:
    """A pattern that backtracks (``^(a|aa)+$``), against 5,000 items that each take it 0.5 to 3 ms
    to refuse, far under the 0.1 s a match may take (at 25 ms each, a busy machine's slow moment
    took one past it, and the call was refused for that match instead): the call's matches are
    bounded in all, so the call is refused once they have taken a second, not after the seconds
    all of them take, and says so; one item that matches still goes. The items must not match
    (``not``): each is then no error, and every one is matched. Items that should match and don't
    stopped the check at its 100th error (ERRORS_WEIGHED), which a quick machine reached in under a
    second, so the test failed there."""
    [slow] = _calls_with(api, hostile, "misspell", "words", '["a" * 22 + "!"] * 5000')
    assert slow[0] == "invalid_arguments", slow
    assert slow[1].startswith("the tool's input schema has patterns that took over 1 s in all to match"), slow
    [ok] = _calls_with(api, hostile, "spell", "words", '["aaaa"]')
    assert ok == ["ok", "{'ok': True}"], ok


HOSTILE_MCP_SERVER = str(HERE / "hostile_mcp_server.py")


def test_an_mcp_text_of_json_nested_too_deep_is_the_text(
    api: Api, staff: Api, create_toolset: Callable[..., dict[str, Any]]
) -> None:
    """A tool's text that starts like JSON is decoded; one nested 5,000 deep can't be (the decoder
    recurses), and is what any other text that is not JSON is: the text. Its call failed with
    internal_error ("see its log"), the RecursionError escaping the tools worker."""
    key = unique_key("deep")
    create_toolset(
        {"key": key, "name": key, "kind": "mcp", "config": mcp_stdio_config(uuid.uuid4().hex, HOSTILE_MCP_SERVER, "deep")}
    )
    assert staff.post(f"/api/v1/toolsets/{key}/sync").status_code == 200
    code = f"from ptc_tools.{key} import {class_name(key)} as M\ntext = M.nested()\nprint(type(text).__name__, len(text))"
    job = api.run(code, toolsets=[key])
    assert job["status"] == "completed", job["error"]
    assert job["stdout"] == "str 10000\n"
    assert [c["status"] for c in job["tool_calls"]] == ["completed"]


def test_an_mcp_server_whose_tool_list_pages_without_end_fails_its_sync_at_once(
    staff: Api, create_toolset: Callable[..., dict[str, Any]]
) -> None:
    """Each page empty, each naming the same next one: the listing stopped only at its 10,000th
    tool, which never came, so the sync ran until its time was up (a minute and more of the web
    process's) and then said the server had not answered. A page named twice is said so, at once."""
    key = unique_key("pages")
    config = {**mcp_stdio_config(uuid.uuid4().hex, HOSTILE_MCP_SERVER, "pages"), "init_timeout": 2}
    create_toolset({"key": key, "name": key, "kind": "mcp", "config": config})
    started = time.monotonic()
    sync = staff.post(f"/api/v1/toolsets/{key}/sync")
    seconds = time.monotonic() - started
    assert sync.status_code == 502, sync.text
    assert sync.json()["error"]["code"] == "mcp_bad_response", sync.text
    assert "the-same-page" in sync.json()["error"]["message"] and seconds < 10, (seconds, sync.text)


@pytest.mark.parametrize(
    ("kind", "config", "field"),
    [
        ("http", {"base_url": "http://127.0.0.1:9/{{secrets.K}}"}, "config.base_url"),
        ("mcp", {"transport": "stdio", "command": "{{secrets.K}}"}, "config.command"),
        ("mcp", {"transport": "stdio", "command": "server", "args": ["--key", "{{ secrets.K }}"]}, "config.args"),
        ("mcp", {"transport": "streamable_http", "url": "http://127.0.0.1:9/mcp?key={{secrets.K}}"}, "config.url"),
    ],
)
def test_a_secret_named_where_none_is_filled_in_is_refused(staff: Api, kind: str, config: dict[str, Any], field: str) -> None:
    """Secrets are filled in in an http toolset's headers and an MCP server's env and headers only:
    named anywhere else, the reference was saved and sent as it is written, ``{{secrets.K}}``, to
    the server (in its URL, its command line), and the call failed far from the cause."""
    key = unique_key("nowhere")
    body = {"key": key, "name": key, "kind": kind, "config": config, "secrets": {"K": SECRET}}
    response = staff.post("/api/v1/toolsets", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid_config" and set(error["details"]) == {field}, error
    assert "only in" in json.dumps(error["details"]) and SECRET not in response.text, error


def test_an_mcp_servers_url_is_not_quoted_to_the_tenants_calling_it(
    api: Api, create_toolset: Callable[..., dict[str, Any]]
) -> None:
    """A global toolset's config is the operator's (its owner and staff read it, no tenant does):
    a hosted MCP server's URL holds its host and, often, the token it is reached by. A call that
    can't reach it quoted the URL whole to every tenant's code, its record and its events."""
    key, token = unique_key("hosted"), uuid.uuid4().hex
    url = f"http://127.0.0.1:9/mcp/s/{token}/mcp"  # nothing listens on port 9
    tool = {"name": "lookup", "input_schema": {"type": "object"}}
    create_toolset(
        {"key": key, "name": key, "kind": "mcp", "config": {"transport": "streamable_http", "url": url}, "tools": [tool]}
    )
    job, lines = _calls(api, key, "T.lookup()")
    [failed] = lines
    assert failed.startswith(f"mcp_start_failed | could not connect to the MCP server of toolset '{key}'"), failed
    assert token not in json.dumps(job) and "127.0.0.1:9" not in json.dumps(job), failed
    assert token not in (ARTIFACTS / "tools-worker.log").read_text(errors="replace")


def test_an_answer_that_cannot_be_read_is_not_said_to_be_no_answer(api: Api, hostile: str) -> None:
    """A body cut short of its Content-Length, or said to be gzip and not: the server answered, and
    the message says so (with the status), not that the server could not be reached."""
    _, lines = _calls(api, hostile, "T.cut()\nT.gzip()\nT.ok()")
    cut, gzip, ok = lines
    assert cut.startswith("http_connection_error | GET /cut answered HTTP 200 but its answer could not be read: "), cut
    assert "RemoteProtocolError" in cut, cut
    assert gzip.startswith("http_connection_error | GET /gzip answered HTTP 200 but its answer could not be read: "), gzip
    assert "DecodingError" in gzip, gzip
    assert ok == "ok | {'ok': True}"


def test_a_schema_whose_check_doubles_at_each_step_fails_the_call_in_time(api: Api, hostile: str) -> None:
    """30 definitions, each any of the next twice: a value it takes is found at the first try, one it
    refuses only after 2**30 tries, which never end (the job lost its lease, and the exec worker's
    thread went on). A call's check is bounded in all: the call is refused, the next one runs."""
    job, lines = _calls(api, hostile, 'T.either(x=1)\nT.either(x="one")\nT.either(x=2)')
    one, refused, two = lines
    assert one == two == "ok | {'ok': True}", (one, two)
    assert refused == "invalid_arguments | the tool's input schema took over 2 s to check these arguments; the call was not run"
    assert [c["status"] for c in job["tool_calls"]] == ["completed", "failed", "completed"]


def test_an_mcp_output_schema_that_backtracks_does_not_freeze_the_tools_worker(
    api: Api, staff: Api, create_toolset: Callable[..., dict[str, Any]]
) -> None:
    """The SDK checks a tool's structured output against the output schema the server lists, with
        Python's ``re``: ``^(a+)+$`` against 40 a's and a ``!`` backtracks for days holding the GIL, and
        the whole tools worker froze (every call on it, its leases). Checked as arguments are (bounded
        patterns, within the check's time, off the MCP loop), the output is refused at once (the ``regex``
    module does not backtrack on this one): mcp_invalid_output; the server's next call runs."""
    key = unique_key("redos")
    create_toolset(
        {"key": key, "name": key, "kind": "mcp", "config": mcp_stdio_config(uuid.uuid4().hex, HOSTILE_MCP_SERVER, "redos")}
    )
    assert staff.post(f"/api/v1/toolsets/{key}/sync").status_code == 200
    job, lines = _calls(api, key, "T.spell()\nT.plain()")
    spell, plain = lines
    assert spell == (
        f"mcp_invalid_output | Invalid structured content returned by tool spell: {'a' * 40 + '!'!r} does not match '^(a+)+$'"
    )
    assert plain == "ok | plain"
    assert [c["status"] for c in job["tool_calls"]] == ["failed", "completed"]


@pytest.mark.parametrize("pattern", ["a{99999999999}", "(" * 2000 + ")" * 2000])
def test_a_pattern_python_cannot_compile_in_a_schema_is_a_field_error(api: Api, staff: Api, pattern: str) -> None:
    """A schema's ``pattern`` is checked as a regex when the schema is: one whose repeat count
    overflows, or nested past the parser's recursion, raised out of the check, a 500 for a job's
    client tools (any caller's) and for a toolset (staff's, an MCP server's listing at its sync)."""
    schema = {"type": "object", "properties": {"x": {"type": "string", "pattern": pattern}}}
    client = api.post("/api/v1/exec", json={"code": "1", "client_tools": [{"name": "t", "input_schema": schema}]})
    assert client.status_code == 400, client.text[:300]
    assert (
        client.json()["error"]["code"] == "validation_error"
        and "client_tools[0].input_schema" in client.json()["error"]["details"]
    )
    key = unique_key("regex")
    tool = {"name": "t", "input_schema": schema, "http": {"method": "GET", "path": "/", "query": []}}
    body = {"key": key, "name": key, "kind": "http", "config": {"base_url": "http://127.0.0.1:9"}, "tools": [tool]}
    toolset = staff.post("/api/v1/toolsets", json=body)
    assert toolset.status_code == 400, toolset.text[:300]
    assert toolset.json()["error"]["code"] == "invalid_json_schema", toolset.text[:300]


def test_a_pattern_whose_repeats_nest_too_large_is_refused_where_the_schema_is_written(api: Api, staff: Api) -> None:
    """A pattern regex would write out to a million items as it compiles was refused by each call of
    its tool (invalid_arguments, tests/tools/test_arguments.py), and taken where it was written: a
    job's client tools ran their code for nothing, a toolset was saved with tools none could call.
    It is refused there, naming the schema and its pattern: a job's client tools (exec and the prompt
    context, its input or output schema), a toolset created or edited (nothing saved)."""
    nested = "^(?:(?:a{100}){100}){100}$"
    why = f"the schema has a pattern ({nested!r}) whose repeats make it too large"
    by_value = {"type": "object", "properties": {"s": {"type": "string", "pattern": nested}}}
    by_key = {"type": "object", "patternProperties": {nested: {}}}
    before = api.get("/api/v1/exec").json()["count"]
    for path, body, field in (
        ("/api/v1/exec", {"code": "1", "client_tools": [{"name": "t", "input_schema": by_value}]}, "input_schema"),
        ("/api/v1/ptc/context", {"client_tools": [{"name": "t", "output_schema": by_key}]}, "output_schema"),
    ):
        client = api.post(path, json=body)
        assert client.status_code == 400, client.text[:300]
        error = client.json()["error"]
        assert error["code"] == "validation_error", error
        assert error["details"][f"client_tools[0].{field}"][0].startswith(why), error
    assert api.get("/api/v1/exec").json()["count"] == before
    key = unique_key("nested")
    spec = {"method": "GET", "path": "/", "query": []}
    body = {"key": key, "name": key, "kind": "http", "config": {"base_url": "http://127.0.0.1:9"}}
    created = staff.post("/api/v1/toolsets", json={**body, "tools": [{"name": "t", "input_schema": by_value, "http": spec}]})
    assert created.status_code == 400, created.text[:300]
    assert created.json()["error"]["code"] == "invalid_json_schema", created.text[:300]
    assert created.json()["error"]["details"]["tools[0].input_schema"][0].startswith(why), created.text[:300]
    plain = {"name": "t", "input_schema": {"type": "object", "properties": {}}, "http": spec}
    assert staff.post("/api/v1/toolsets", json={**body, "tools": [plain]}).status_code == 201
    edited = staff.http.patch(f"/api/v1/toolsets/{key}", json={"tools": [{**plain, "output_schema": by_key}]})
    assert edited.status_code == 400, edited.text[:300]
    assert edited.json()["error"]["details"]["tools[0].output_schema"][0].startswith(why), edited.text[:300]
    assert staff.get(f"/api/v1/toolsets/{key}").json()["tools"][0]["output_schema"] is None
    staff.http.delete(f"/api/v1/toolsets/{key}")


def test_json_with_a_number_too_long_to_read_is_not_said_not_to_be_json(api: Api, hostile: str) -> None:
    """A body of JSON whose number has 5,000 digits: Python reads no integer of over 4,300. That is
    what the message says, not that the body (application/json, and JSON) is not JSON."""
    _, lines = _calls(api, hostile, "T.bigint()")
    [bigint] = lines
    assert bigint.startswith(
        'http_invalid_json | GET /bigint answered HTTP 200 with JSON holding a number too long to read: {"n": 111'
    ), bigint[:200]


def test_a_compressed_answer_is_inflated_no_further_than_a_call_may_answer(stack: Stack, api: Api, hostile: str) -> None:
    """200 MiB of gzip (200 KiB sent), and of deflate then gzip (a few hundred bytes sent), as an
    answer and as an error's body: httpx inflates each piece the server sends whole, before our
    count of the body sees it, so one piece of 64 KiB became 64 MiB in the tools worker's memory,
    and the few hundred bytes of two codings 200 MiB at once; dozens of such calls at a time are
    gigabytes. Before the fix, the worker's peak rose 409 MiB for these three calls ("the tools
    worker's peak rose 409 MiB ... assert 409 < 32"; 7 MiB after). Each is inflated a piece at a
    time, no further than the call may answer: output_too_large, or the error's excerpt; a
    compressed answer within the limit still reads, gzip or deflate (raw, as some servers send it).
    """
    assert stack.tools_worker.proc is not None
    pid = stack.tools_worker.proc.pid
    before = peak_reset(pid)
    bombs = 'T.bomb(enc="gzip")\nT.bomb(enc="deflate, gzip")\nT.bomb(enc="gzip", status=500)\n'
    job, lines = _calls(api, hostile, bombs + 'T.zipped(enc="gzip")\nT.zipped(enc="deflate")')
    risen = peak_mb(pid) - before
    gzip, twice, error, zipped, deflated = lines
    most = settings.PTC_MAX_TOOL_OUTPUT_BYTES
    assert gzip == twice == f"output_too_large | GET /bomb answered over {most} bytes; the limit is {most}", (gzip, twice)
    status = "HTTP 500 Internal Server Error: "
    assert error == f"http_error | GET /bomb answered {status}" + "x" * (300 - len(status)) + "…", error
    assert zipped == deflated == "ok | {'ok': True}", (zipped, deflated)
    _whole(job)
    assert risen < 32, f"the tools worker's peak rose {risen} MiB while it read 3 answers of 200 MiB each, compressed"


def test_an_mcp_server_line_too_long_to_be_an_answer_ends_its_session_not_the_worker(
    stack: Stack, api: Api, staff: Api, create_toolset: Callable[..., dict[str, Any]]
) -> None:
    """A stdio server's answer of 24 MiB on one line, to a call and to the tools' listing: the SDK
    reads a line without bound, joining each 64 KiB piece to all of the line read before it (20 MB
    took 2 s of the event loop every session of the worker waits on; a line without end, memory
    without end). Before the fix the call took 6 s and 144 MiB of the worker's memory to fail far
    from the cause ("assert 'output_too_large | the tool returned 25165826 bytes of JSON; the limit
    is 1048576' == 'mcp_bad_response | ...'"). A line is read no further than 4 times a call's
    output may be: the call and the sync fail mcp_bad_response saying so, the session is closed,
    and the server's next call runs on a new one (0.2 s and 4 MiB)."""
    key, listing = unique_key("long"), unique_key("long_list")
    for made, mode in ((key, "long"), (listing, "long_list")):
        config = mcp_stdio_config(uuid.uuid4().hex, HOSTILE_MCP_SERVER, mode)
        create_toolset({"key": made, "name": made, "kind": "mcp", "config": config})
    assert staff.post(f"/api/v1/toolsets/{key}/sync").status_code == 200
    assert _calls(api, key, "T.plain()")[1] == ["ok | plain"]  # the SDK loaded, a session open: not counted
    assert stack.tools_worker.proc is not None
    pid = stack.tools_worker.proc.pid
    before = peak_reset(pid)
    started = time.monotonic()
    job, lines = _calls(api, key, "T.huge()\nT.plain()")
    seconds, risen = time.monotonic() - started, peak_mb(pid) - before
    huge, plain = lines
    most = 4 * settings.PTC_MAX_TOOL_OUTPUT_BYTES
    too_long = f"the server sent a line of over {most:,} bytes, more than any answer may be; its session was closed"
    assert huge == f"mcp_bad_response | MCP tool 'huge': {too_long}", huge[:300]
    assert plain == "ok | plain"
    assert [c["status"] for c in job["tool_calls"]] == ["failed", "completed"]
    assert seconds < 5 and risen < 32, (seconds, risen)
    sync = staff.post(f"/api/v1/toolsets/{listing}/sync")
    assert sync.status_code == 502, sync.text[:300]
    error = sync.json()["error"]
    assert error["code"] == "mcp_bad_response" and too_long in error["message"], error


def test_the_exception_a_builtin_raised_is_quoted_cut(api: Api) -> None:
    """A builtin's exception says what it was given: ``echo`` called with an argument its function
    does not take (its schema allows any) raises TypeError naming it, and a name of 500,000
    characters went whole into the code's ToolError, the call's record and its events. Before the
    fix: ("tool_exception | TypeError: echo() got an unexpected keyword argument 'kkkkkk | kkkkkkkkk'
    | 500055"). It is quoted as an excerpt, its start; the next call runs. The worker's log got it
    whole too, in its traceback ("assert (3704595 - 3202212) < 50000"): cut there in its middle."""
    code = """
from ptc_tools import ToolError, _runtime
try:
    _runtime.call("demo", "echo", {"value": 1, "k" * 500_000: 1})
except ToolError as e:
    print(e.code, "|", e.message[:60], "|", e.message[-10:], "|", len(e.message))
print(_runtime.call("demo", "echo", {"value": 1}))
"""
    log = ARTIFACTS / "tools-worker.log"
    logged = log.stat().st_size
    job = api.run(code, toolsets=["demo"])
    assert job["status"] == "completed", job["error"]
    # And the worker's log, where it went whole too, with its traceback: 500 KB a call.
    assert log.stat().st_size - logged < 50_000, log.stat().st_size - logged
    raised, ok = job["stdout"].splitlines()
    code_, start, end, length = raised.split(" | ")
    assert code_ == "tool_exception" and start.startswith("TypeError: echo() got an unexpected keyword argument 'kkk"), raised
    assert end == "kkkkkkkkk…" and int(length) < 1000, raised
    assert ok == "1"
    assert [c["status"] for c in job["tool_calls"]] == ["failed", "completed"]
    assert all(len(c["error"]["message"]) < 1000 for c in job["tool_calls"] if c["error"])


def test_an_mcp_server_that_cannot_be_started_is_not_named_by_its_path(
    api: Api, create_toolset: Callable[..., dict[str, Any]]
) -> None:
    """A global toolset's config is the operator's: no tenant reads it (its command names where the
    deployment keeps its servers, and whose home they are in). A command that could not be run
    was quoted whole, by the OSError's message, to every tenant's code, its record and its events:
    before the fix ("mcp_start_failed | the MCP server of toolset '...' could not be started:
    [Errno 2] No such file or directory: '/srv/<token>/mcp-server'", and "[Errno 13] Permission
    denied: '/tmp/hA/tests/tools'" for a directory). The message says why, not where."""
    token = uuid.uuid4().hex
    tool = {"name": "anything", "input_schema": {"type": "object"}}
    missing, directory = unique_key("missing"), unique_key("directory")
    for key, command in ((missing, f"/srv/{token}/mcp-server"), (directory, str(HERE))):
        config = {"transport": "stdio", "command": command}
        create_toolset({"key": key, "name": key, "kind": "mcp", "config": config, "tools": [tool]})
    code = f"""
from ptc_tools import ToolError, _runtime
for key in ("{missing}", "{directory}"):
    try:
        _runtime.call(key, "anything", {{}})
    except ToolError as e:
        print(e.code, "|", e.message)
"""
    job = api.run(code, toolsets=[missing, directory])
    assert job["status"] == "completed", job["error"]
    assert job["stdout"].splitlines() == [
        f"mcp_start_failed | the MCP server of toolset '{key}' could not be started: its command could not be run"
        f" ({why}); an admin must check the toolset's command"
        for key, why in ((missing, "No such file or directory"), (directory, "Permission denied"))
    ], job["stdout"]
    assert token not in json.dumps(job) and str(HERE) not in json.dumps(job)


def test_an_mcp_answer_over_http_is_read_no_further_than_any_answer_may_be(
    stack: Stack, api: Api, mcp_upstream: str, create_toolset: Callable[..., dict[str, Any]]
) -> None:
    """A hosted MCP server's answer of JSON (a text of 64 MiB, 64 KiB of gzip sent): the SDK reads
    such an answer whole (``aread``), however far it inflates, and the call's output was checked
    only after. Before the fix ("AssertionError: output_too_large | the tool returned 67108866
    bytes of JSON; the limit is 1048576", after the worker's peak rose 321 MiB; 300 MiB sent the
    same way, 1.5 GiB). An answer is read as a stdio server's line is, no further than 4 times a
    call's output may be: mcp_bad_response saying so (5 MiB); the server's next call runs."""
    key = unique_key("hosted_huge")
    tools = [{"name": name, "input_schema": {"type": "object"}} for name in ("huge", "plain")]
    config = {"transport": "streamable_http", "url": mcp_upstream}
    create_toolset({"key": key, "name": key, "kind": "mcp", "config": config, "tools": tools})
    assert _calls(api, key, "T.plain()")[1] == ["ok | plain"]  # the SDK loaded, a session open: not counted
    assert stack.tools_worker.proc is not None
    pid = stack.tools_worker.proc.pid
    before = peak_reset(pid)
    job, lines = _calls(api, key, "T.huge()\nT.plain()")
    risen = peak_mb(pid) - before
    huge, plain = lines
    most = 4 * settings.PTC_MAX_TOOL_OUTPUT_BYTES
    assert huge == (
        f"mcp_bad_response | MCP tool 'huge': the server sent an answer of over {most:,} bytes, more than any answer"
        " may be; its session was closed"
    ), huge[:300]
    assert plain == "ok | plain"
    assert [c["status"] for c in job["tool_calls"]] == ["failed", "completed"]
    assert risen < 32, f"the tools worker's peak rose {risen} MiB while it read an answer of 64 MiB, compressed"


def test_an_mcp_servers_tools_are_listed_no_further_than_a_listing_may_be(
    staff: Api, create_toolset: Callable[..., dict[str, Any]]
) -> None:
    """Page after page, each within a line's bound (one tool with a description of 1 MiB): a
    listing stopped only at its 10,000th tool, so a server could have the web process hold and
    store 10,000 lines of 4 MiB. Before the fix, 24 pages of it were synced as 24 tools ("assert
    200 == 502"). A listing is read to 4 lines' worth in all, and the sync says so."""
    key = unique_key("heavy")
    config = mcp_stdio_config(uuid.uuid4().hex, HOSTILE_MCP_SERVER, "heavy")
    create_toolset({"key": key, "name": key, "kind": "mcp", "config": config})
    sync = staff.post(f"/api/v1/toolsets/{key}/sync")
    assert sync.status_code == 502, sync.text[:300]
    error = sync.json()["error"]
    most = 16 * settings.PTC_MAX_TOOL_OUTPUT_BYTES
    assert error["code"] == "mcp_bad_response", error
    assert f"lists over {most:,} bytes of tools (after 16 pages and 16 tools)" in error["message"], error


def test_an_answer_in_more_codings_than_are_undone_is_said_so(api: Api, hostile: str) -> None:
    """JSON gzipped 2,000 times over (a header of 12 KB says so): each piece was inflated through a
    chain 2,000 generators deep, and the call ended in a RecursionError ("AssertionError:
    internal_error | the tools worker failed while running this call; see its log"). More than 4
    codings are refused, as a body not in the coding it says is; the next call runs."""
    _, lines = _calls(api, hostile, "T.onion()\nT.ok()")
    onion, ok = lines
    assert onion == (
        "http_connection_error | GET /onion answered HTTP 200 but its answer could not be read: DecodingError:"
        " the Content-Encoding names 2000 codings; at most 4 are undone"
    ), onion
    assert ok == "ok | {'ok': True}"
