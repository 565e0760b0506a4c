"""The http kind, end to end: a job's code calls a local HTTP API through the tools worker. Errors come
back as ToolErrors with the status and an excerpt, secrets redacted, and the job carries on."""

import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.conftest import Api
from tests.stack import ARTIFACTS
from tests.tools.conftest import unique_key
from tests.tools.http_api import HttpApi
from tools.errors import ToolFailure
from tools.models import Tool, Toolset
from tools.sdk import class_name

SECRET = f"key-{uuid.uuid4().hex}"


@pytest.fixture(scope="module")
def http_api() -> Iterator[HttpApi]:
    with HttpApi(expected_key=SECRET) as server:
        yield server


def _tool(
    name: str, method: str, path: str, properties: dict[str, Any], required: list[str], query: list[str], **extra: Any
) -> dict[str, Any]:
    schema = {"type": "object", "properties": properties, "required": required}
    return {"name": name, "input_schema": schema, "http": {"method": method, "path": path, "query": query}, **extra}


def _keyed(create: Callable[..., dict[str, Any]], url: str, secret: str, header: str, tool: dict[str, Any]) -> str:
    """Create an http toolset that sends ``secret`` in its X-Key header (``header``, with ``{}`` for
    the secret) and has the one ``tool``; return its key."""
    key = unique_key(tool["name"])
    config = {"base_url": url, "headers": {"X-Key": header.format("{{secrets.K}}")}}
    create({"key": key, "name": key, "kind": "http", "config": config, "secrets": {"K": secret}, "tools": [tool]})
    return key


@pytest.fixture
def weather(http_api: HttpApi, create_toolset: Callable[..., dict[str, Any]]) -> str:
    key = unique_key("weather")
    city = {"city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"}}
    drip = {"part": {"type": "string"}, "cap": {"type": "number"}}
    create_toolset(
        {
            "key": key,
            "name": "Weather",
            "kind": "http",
            "config": {"base_url": http_api.url, "headers": {"X-Key": "{{secrets.WEATHER_KEY}}"}, "timeout": 10},
            "secrets": {"WEATHER_KEY": SECRET},
            "tools": [
                _tool("forecast", "GET", "/forecast/{city}", city, ["city"], ["days"], read_only=True),
                _tool("add_item", "POST", "/items/{city}", {**city, "note": {"type": "string"}}, ["city"], ["days"]),
                _tool("whoami", "GET", "/whoami", {}, [], []),
                _tool("explode", "GET", "/explode", {}, [], []),
                _tool("html", "GET", "/html", {}, [], []),
                _tool("slow", "GET", "/slow", {"seconds": {"type": "number"}}, [], ["seconds"], timeout=1),
                _tool("empty", "DELETE", "/empty", {}, [], []),
                _tool("reason", "GET", "/reason", {}, [], []),
                _tool("huge", "GET", "/huge", {"bytes": {"type": "integer"}}, [], ["bytes"]),
                _tool("deep", "GET", "/deep", {}, [], []),
                _tool("moved", "GET", "/moved", {}, [], []),
                _tool("drip", "GET", "/drip", drip, [], list(drip), timeout=1),
                _tool("padded", "GET", "/padded", {"pad": {"type": "integer"}}, [], ["pad"]),
                _tool("lookup", "GET", "/forecast/{city}", {"city": city["city"], "q": {"type": "string"}}, ["city"], ["q"]),
            ],
        }
    )
    return key


def test_calls_fill_path_query_body_and_secret_headers(api: Api, weather: str) -> None:
    cls = class_name(weather)
    code = f"""
from ptc_tools.{weather} import {cls} as W
print(W.forecast(city="São Paulo", days=3, metric=True))
print(W.add_item(city="oslo", days=2, note="hello"))
print(W.whoami())
W.empty()
"""
    job = api.run(code, toolsets=[weather])
    assert job["status"] == "completed", job["error"]
    lines = job["stdout"].splitlines()
    forecast = eval(lines[0])
    assert forecast == {"city": "São Paulo", "query": {"days": "3", "metric": "true"}, "authorized": True}
    item = eval(lines[1])
    assert item == {"method": "POST", "path": "/items/oslo", "query": {"days": "2"}, "body": {"note": "hello"}}
    # The API echoed the secret header back: the value the code sees is redacted.
    assert eval(lines[2]) == {"you_sent": "[redacted]"}
    assert job["return_value"] is None
    assert SECRET not in json.dumps(job)


def test_errors_are_tool_errors_with_status_and_redacted_excerpt(api: Api, weather: str) -> None:
    cls = class_name(weather)
    code = f"""
from ptc_tools import ToolError
from ptc_tools.{weather} import {cls} as W
for call in (W.explode, W.html, lambda: W.slow(seconds=5)):
    try:
        call()
    except ToolError as e:
        print(e.code, "|", e.message)
print("still running")
"""
    job = api.run(code, toolsets=[weather])
    assert job["status"] == "completed", job["error"]
    explode, html, slow, tail = job["stdout"].splitlines()
    assert explode.startswith("http_error | GET /explode answered HTTP 500 Internal Server Error: Internal error")
    assert "upstream refused key [redacted] for this request" in explode
    assert html.startswith("http_invalid_json | GET /html answered HTTP 200 with text/html, not JSON: <html>")
    assert slow == "http_timeout | GET /slow got no answer within 1 s"
    assert tail == "still running"
    codes = [c["error"]["code"] for c in job["tool_calls"]]
    assert codes == ["http_error", "http_invalid_json", "http_timeout"]
    assert SECRET not in json.dumps(job)
    # Nor in the tools worker's log.
    assert SECRET not in (ARTIFACTS / "tools-worker.log").read_text(errors="replace")


def test_a_secret_of_digits_echoed_as_a_number_is_redacted(
    api: Api, http_api: HttpApi, create_toolset: Callable[..., dict[str, Any]]
) -> None:
    """An account number or a PIN as a secret header, echoed back as a JSON number: numbers are
    redacted as JSON writes them, as strings are; the other numbers stay numbers."""
    digits = str(uuid.uuid4().int)[:15]
    key = _keyed(create_toolset, http_api.url, digits, "{}", _tool("account", "GET", "/account", {}, [], []))
    job = api.run(f"from ptc_tools.{key} import {class_name(key)} as D\nprint(D.account())", toolsets=[key])
    assert job["status"] == "completed", job["error"]
    assert eval(job["stdout"]) == {"account": "[redacted]", "balance": 12.5}
    assert digits not in json.dumps(job)


def test_an_error_page_cut_for_its_excerpt_mid_secret_shows_no_part_of_it(api: Api, weather: str) -> None:
    """A 401 page: a line, spaces, then the secret header echoed back. Only its start is read, for
    the excerpt, and the spaces collapse there: wherever the cut falls in the secret, no part of it
    shows (a secret's start no longer matches the secret)."""
    code = f"""
from ptc_tools import ToolError
from ptc_tools.{weather} import {class_name(weather)} as W
for pad in range(1140, 1260, 6):
    try:
        W.padded(pad=pad)
    except ToolError as e:
        print(e.code, "|", e.message)
"""
    job = api.run(code, toolsets=[weather])
    assert job["status"] == "completed", job["error"]
    lines = job["stdout"].splitlines()
    assert len(lines) == 20
    assert all(line.startswith("http_error | GET /padded answered HTTP 401 Unauthorized: Unauthorized.") for line in lines)
    assert lines[0].endswith("key=[redacted]")  # read whole: redacted where it is
    assert SECRET[:5] not in json.dumps(job)  # "key-" and the first of its random characters


def test_a_proxy_the_environment_names_is_used_and_held_to_the_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    # A worker's own client, as a tools worker's thread makes it: the deadline's backend on every
    # pool, and the proxy from the environment kept (giving httpx a transport would drop it).
    from tools.kinds import http

    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:3128")
    monkeypatch.delattr(http._local, "client", raising=False)
    client = http._client()
    try:
        proxies = [t for pattern, t in client._mounts.items() if pattern.scheme == "https" and t is not None]
        assert len(proxies) == 1 and type(proxies[0]._pool).__name__ == "HTTPProxy"
        pools = [client._transport._pool, proxies[0]._pool]
        assert all(isinstance(pool._network_backend, http._DeadlineBackend) for pool in pools)
    finally:
        client.close()
        del http._local.client


def test_an_answer_sent_a_byte_at_a_time_ends_at_the_tools_timeout(api: Api, weather: str, http_api: HttpApi) -> None:
    """A server that sends its headers, or then a 1 MiB body, a byte every 0.3 s: each read is quick,
    the whole is not. The tool's timeout (1 s) bounds the whole request: the call ends http_timeout
    then, and the tools worker closes the connection (its thread is what serves the next call),
    which the server finds before its own end (8 s here: ``cap``), however loaded the machine.
    Before, each call went on until the server stopped, and said something else."""
    code = f"""
from ptc_tools import ToolError
from ptc_tools.{weather} import {class_name(weather)} as W
for part in ("headers", "body"):
    try:
        W.drip(part=part, cap=8)
    except ToolError as e:
        print(e.code, "|", e.message)
"""
    before = len(http_api.drips)
    job = api.run(code, toolsets=[weather])
    assert job["status"] == "completed", job["error"]
    headers, body = [line.split(" | ") for line in job["stdout"].splitlines()]
    assert headers == ["http_timeout", "GET /drip got no answer within 1 s"]
    assert body == ["http_timeout", "GET /drip answered HTTP 200 but did not send all its body within 1 s"]
    # The server's next writes after the worker closed the connection fail (a byte every 0.3 s).
    deadline = time.monotonic() + 10
    while len(http_api.drips) < before + 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    drips = http_api.drips[before:]
    assert [(d["part"], d["how"]) for d in drips] == [("headers", "client closed"), ("body", "client closed")], drips


def test_arguments_that_make_a_url_too_long_are_invalid_arguments(api: Api, weather: str) -> None:
    """A 70,000-character argument, well under the arguments' limit, in the path or in the query:
    httpx refuses a URL that long. That is the call's input, said so, not the worker failing; the
    next call runs."""
    code = f"""
from ptc_tools import ToolError
from ptc_tools.{weather} import {class_name(weather)} as W
for call in (lambda: W.lookup(city="a" * 70000), lambda: W.lookup(city="oslo", q="a" * 70000)):
    try:
        call()
    except ToolError as e:
        print(e.code, "|", e.message)
print(W.lookup(city="oslo", q="next"))
"""
    job = api.run(code, toolsets=[weather])
    assert job["status"] == "completed", job["error"]
    in_path, in_query, then = job["stdout"].splitlines()
    assert in_path.startswith("invalid_arguments | GET /forecast/{city} can't be sent with these arguments: URL")
    assert in_query.startswith("invalid_arguments | GET /forecast/{city} can't be sent with these arguments: URL")
    assert "65,536 characters" in in_path and len(in_path) < 400
    assert eval(then)["query"] == {"q": "next"}


def test_a_missing_path_argument_is_refused_before_the_request(api: Api, weather: str) -> None:
    job = api.run(
        f"from ptc_tools.{weather} import {class_name(weather)} as W\nW.forecast(days=1)",
        toolsets=[weather],
    )
    assert job["status"] == "failed"
    assert "city" in job["error"]["message"]


def test_hostile_answers_and_path_arguments_end_as_tool_errors(
    api: Api, staff: Api, weather: str, http_api: HttpApi, create_toolset: Callable[..., dict[str, Any]]
) -> None:
    from django.conf import settings

    # A secret pasted with its newline: httpx refuses the header, and its error quotes it escaped.
    whoami = _tool("whoami", "GET", "/whoami", {}, [], [])
    pasted = _keyed(create_toolset, http_api.url, SECRET + "\n", "{}", whoami)
    # A secret not ASCII, as HTTP headers are: refused as it is written, naming it, not quoting it.
    accented = _keyed(create_toolset, http_api.url, SECRET, "Key {}", whoami)
    refused = staff.http.patch(f"/api/v1/toolsets/{accented}", json={"secrets": {"K": "pässwort-" + SECRET}})
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_config", refused.text
    assert "'K'" in refused.text and "pässwort" not in refused.text and SECRET not in refused.text
    # One written before that check (a row as it stands): httpx can't encode the header.
    row = Toolset.objects.get(key=accented)
    row.secrets = {"K": "pässwort-" + SECRET}
    row.save()
    over = settings.PTC_MAX_TOOL_OUTPUT_BYTES + 1
    code = f"""
from ptc_tools import ToolError
from ptc_tools.{weather} import {class_name(weather)} as W
from ptc_tools.{pasted} import {class_name(pasted)} as P
from ptc_tools.{accented} import {class_name(accented)} as A
calls = (
    W.reason, lambda: W.huge(bytes={over}), W.deep, lambda: W.forecast(city=".."), lambda: W.forecast(city="."), P.whoami, W.moved,
    A.whoami,
)
for call in calls:
    try:
        call()
    except ToolError as e:
        print(e.code, "|", e.message)
"""
    job = api.run(code, toolsets=[weather, pasted, accented])
    assert job["status"] == "completed", job["error"]
    reason, huge, deep, up, here, newline, moved, not_ascii = job["stdout"].splitlines()
    assert reason == "http_error | GET /reason answered HTTP 500 Bad key [redacted]:"
    assert huge.startswith(f"output_too_large | GET /huge answered over {over - 1} bytes")
    assert deep.startswith("http_invalid_json | GET /deep answered HTTP 200 with JSON nested too deep")
    assert up.startswith("invalid_arguments | 'city' can't be '..'") and here.startswith(
        "invalid_arguments | 'city' can't be '.'"
    )
    assert newline.startswith("http_connection_error") and "[redacted]" in newline
    assert moved == (
        "http_error | GET /moved answered HTTP 302 Found: a redirect to https://elsewhere.example/v2/?key=[redacted],"
        " not followed (point the toolset's base_url there)"
    )
    assert not_ascii == (
        "http_config_invalid | the toolset's header 'X-Key' (with the secret 'K') has a character that is not ASCII,"
        " which HTTP headers are; an admin must change it (encoded as its API says)"
    )
    assert SECRET not in json.dumps(job) and "pässwort" not in json.dumps(job)
    assert SECRET not in (ARTIFACTS / "tools-worker.log").read_text(errors="replace")


def _forecast_tool(base_url: str, timeout: float) -> tuple[Toolset, Tool]:
    toolset = Toolset(key="weather", name="Weather", kind=Toolset.Kind.HTTP, config={"base_url": base_url})
    spec = {"method": "GET", "path": "/forecast/{city}", "query": []}
    return toolset, Tool(toolset=toolset, name="forecast", http=spec, timeout=timeout)


def test_a_name_whose_lookup_hangs_ends_at_the_tools_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """The deadline bounded the connect, each read and each write, but not the name's lookup: the
    system resolver's own timeouts (5 s a try, tries by name server) held the call past its tool's
    timeout. A resolver that hangs (until the test lets it go, a minute at most) is waited for 0.5 s:
    the call ends, http_timeout, while the lookup still hangs (before: when the lookup ended)."""
    from tools.kinds import http

    real = socket.getaddrinfo
    let_go, answered = threading.Event(), threading.Event()

    def hung(host: str, *args: Any, **kwargs: Any) -> Any:
        if host == "slow.example":
            let_go.wait(60)
            answered.set()
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", hung)
    toolset, tool = _forecast_tool("http://slow.example:9", timeout=0.5)
    try:
        with pytest.raises(ToolFailure) as failure:
            http.run(toolset=toolset, tool=tool, arguments={"city": "paris"}, timeout=30)
        assert not answered.is_set()
    finally:
        let_go.set()
    assert (failure.value.code, failure.value.message) == ("http_timeout", "GET /forecast/paris got no answer within 0.5 s")


def test_each_address_of_a_name_is_tried_in_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    # As socket.create_connection does: a name's first address refuses (nothing listens on
    # 127.0.0.2), its second answers.
    from tools.kinds import http

    real = socket.getaddrinfo

    def two(host: str, port: int, *args: Any, **kwargs: Any) -> Any:
        if host == "two.example":
            return [info for address in ("127.0.0.2", "127.0.0.1") for info in real(address, port, *args, **kwargs)]
        return real(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", two)
    with HttpApi(expected_key="") as server:
        toolset, tool = _forecast_tool(f"http://two.example:{server.server.server_address[1]}", timeout=5)
        answer = http.run(toolset=toolset, tool=tool, arguments={"city": "paris"}, timeout=30)
    assert answer["city"] == "paris"


def test_lookups_that_hang_hold_up_no_other_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """One user's calls to a name whose resolver hangs, each ending at its timeout, left their
    lookups to a pool of 8 threads that every call of the worker shared: the ninth call, to a
    healthy server, waited behind them and failed http_timeout. Each lookup now has a thread of its
    own; past MAX_LOOKUPS at once, a call looks its name up on its own thread, as before."""
    from tools.kinds import http

    real = socket.getaddrinfo

    def slow(host: str, port: int, *args: Any, **kwargs: Any) -> Any:
        if host == "slow.example":
            time.sleep(4)
        if host == "fine.example":
            host = "127.0.0.1"
        return real(host, port, *args, **kwargs)

    def hostile() -> None:
        toolset, tool = _forecast_tool("http://slow.example:9", timeout=0.3)
        with pytest.raises(ToolFailure):
            http.run(toolset=toolset, tool=tool, arguments={"city": "x"}, timeout=30)

    monkeypatch.setattr(socket, "getaddrinfo", slow)
    with HttpApi(expected_key="") as server:
        port = server.server.server_address[1]
        for places in (http.MAX_LOOKUPS, 2):  # every lookup on a thread of its own; then most on their caller's
            monkeypatch.setattr(http, "_lookups", (os.getpid(), threading.BoundedSemaphore(places)))
            threads = [threading.Thread(target=hostile) for _ in range(12)]
            for thread in threads:
                thread.start()
            time.sleep(0.5)  # their calls have ended; their lookups go on
            for host in ("127.0.0.1", "fine.example"):
                toolset, tool = _forecast_tool(f"http://{host}:{port}", timeout=2)
                started = time.monotonic()
                assert http.run(toolset=toolset, tool=tool, arguments={"city": "paris"}, timeout=30)["city"] == "paris"
                assert time.monotonic() - started < 1, (places, host)
            for thread in threads:
                thread.join()
