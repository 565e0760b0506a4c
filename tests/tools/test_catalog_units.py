"""The catalog's pure parts, without a stack: names, secrets, HTTP requests, MCP results, checks,
typed returns and the compact reference."""

import json
import time
from types import SimpleNamespace
from typing import Any

import pytest

from tools.context import LEVELS, Level, compact_reference, provider_tools, ptc_context_build
from tools.errors import ToolFailure
from tools.kinds.http import request_parts
from tools.kinds.mcp import result_output, server_for
from tools.models import Tool, Toolset
from tools.sdk import _TypeDefs, shape, summary
from tools.secret_refs import (
    MissingSecret,
    headers_problem,
    secret_names_used,
    secrets_redact,
    secrets_redact_value,
    secrets_render,
    secrets_tail,
)
from tools.services import python_name
from tools.validation import toolset_errors


def test_python_names_for_mcp_tools() -> None:
    assert python_name("get-issue", set()) == "get_issue"
    assert python_name("repo.search", set()) == "repo_search"
    assert python_name("2fa", set()) == "t_2fa"
    assert python_name("class", set()) == "class_"
    assert python_name("get-issue", {"get_issue"}) == "get_issue_2"
    assert python_name("__init__", set()) == "init__"
    # Cut to fit a Tool's name (128), its suffix included.
    assert python_name("x" * 200, set()) == "x" * 128
    assert python_name("x" * 200, {"x" * 128}) == "x" * 126 + "_2"


def test_secret_references() -> None:
    secrets = {"KEY": "abcd1234", "LONGER": "abcd1234-and-more"}
    assert secrets_render("Bearer {{secrets.KEY}}", secrets) == "Bearer abcd1234"
    assert secrets_render("{{ secrets.KEY }}", secrets) == "abcd1234"
    with pytest.raises(MissingSecret):
        secrets_render("{{secrets.NOPE}}", secrets)
    assert secret_names_used({"headers": {"A": "{{secrets.KEY}}", "B": ["{{secrets.X}}"]}}) == {"KEY", "X"}
    # The longer secret is redacted whole, not as the shorter one plus a tail.
    assert secrets_redact("got abcd1234-and-more and abcd1234", secrets.values()) == "got [redacted] and [redacted]"
    assert secrets_redact_value({"abcd1234": ["x abcd1234", 1]}, ["abcd1234"]) == {"[redacted]": ["x [redacted]", 1]}
    assert secrets_redact("a b", ["a"]) == "a b"  # too short to redact without mangling text


def test_headers_that_cant_be_sent_name_their_secret_and_never_quote_it() -> None:
    secrets = {"T": "pässwort-123", "OK": "token-123"}
    assert headers_problem({"A": "Bearer {{secrets.OK}}"}, secrets) is None
    problem = headers_problem({"A": "Bearer {{secrets.OK}}", "B": "x {{secrets.T}}"}, secrets)
    assert problem == "'B' (with the secret 'T') has a character that is not ASCII, which HTTP headers are"
    assert headers_problem({"Ä": "x"}, {}) == "'Ä' has a character that is not ASCII, which HTTP headers are"
    # An MCP server over HTTP, written before writes refused it, fails its calls naming it too.
    config = {"transport": "streamable_http", "url": "http://x/mcp", "headers": {"B": "{{secrets.T}}"}}
    with pytest.raises(ToolFailure) as failed:
        server_for(Toolset(key="remote", kind="mcp", config=config, secrets=secrets))
    assert failed.value.code == "mcp_config_invalid" and "'T'" in failed.value.message
    assert "pässwort" not in failed.value.message and "ä" not in failed.value.message


def test_a_streams_tail_is_cut_where_no_secret_is() -> None:
    assert secrets_tail("0123456789", 4, []) == "6789"
    secrets = ["abcd1234", "abcd1234-and-more"]
    # A secret the cut falls in is kept whole, so redacting the tail finds it.
    assert secrets_tail("x" * 30 + "abcd1234-and-more" + "yy", 10, secrets) == "abcd1234-and-more" + "yy"
    assert secrets_tail("x" * 30 + "abcd1234" + "y" * 20, 25, secrets) == "abcd1234" + "y" * 20
    # One still being written is kept whole: the tail is never shorter than the longest secret.
    assert secrets_tail("x" * 30 + "abcd1234-an", 4, secrets) == "x" * 6 + "abcd1234-an"
    # Keeping one whole may put the cut in another.
    assert secrets_tail("zz" + "aaaa-1111-bbbb", 5, ["aaaa-1111", "1111-bbbb"]) == "aaaa-1111-bbbb"


def test_http_request_parts() -> None:
    spec = {"method": "GET", "path": "/forecast/{city}", "query": ["days"]}
    assert request_parts(spec, {"city": "São Paulo/x", "days": 3, "metric": True}) == (
        "GET",
        "/forecast/S%C3%A3o%20Paulo%2Fx",
        {"days": "3", "metric": "true"},
        None,
    )
    post = {"method": "post", "path": "/items/{id}", "query": ["dry_run"]}
    assert request_parts(post, {"id": 7, "dry_run": False, "name": "n", "tags": ["a"]}) == (
        "POST",
        "/items/7",
        {"dry_run": "false"},
        {"name": "n", "tags": ["a"]},
    )
    with pytest.raises(ToolFailure) as missing:
        request_parts(spec, {"days": 1})
    assert missing.value.code == "invalid_arguments"


def _text(text: str) -> Any:
    return SimpleNamespace(type="text", text=text, model_dump=lambda **_: {"type": "text", "text": text})


def _result(*content: Any, structured: Any = None, error: bool = False) -> Any:
    return SimpleNamespace(content=list(content), structured_content=structured, is_error=error)


def test_mcp_results_become_outputs() -> None:
    assert result_output(_result(_text("{}"), structured={"a": 1}), "t", ()) == {"a": 1}
    assert result_output(_result(_text('[1, {"b": 2}]')), "t", ()) == [1, {"b": 2}]
    assert result_output(_result(_text("plain words")), "t", ()) == "plain words"
    assert result_output(_result(_text("{not json")), "t", ()) == "{not json"
    assert result_output(_result(_text("one"), _text("two")), "t", ()) == "one\ntwo"
    image = SimpleNamespace(type="image", model_dump=lambda **_: {"type": "image", "data": "AAA=", "mimeType": "image/png"})
    assert result_output(_result(_text("caption"), image), "t", ())[1]["type"] == "image"
    with pytest.raises(ToolFailure) as failed:
        result_output(_result(_text("rate limited"), error=True), "t", ())
    assert (failed.value.code, failed.value.message) == ("mcp_tool_error", "rate limited")
    # Redacted before it is cut: the cut can't keep the start of a secret out of redaction's sight.
    with pytest.raises(ToolFailure) as failed:
        result_output(_result(_text("x" * 1990 + " token abcd1234 refused"), error=True), "t", ("abcd1234",))
    assert failed.value.message == "x" * 1990 + " token [re"
    assert result_output(_result(_text('{"token": "abcd1234"}')), "t", ("abcd1234",)) == {"token": "[redacted]"}


def _tool(**fields: Any) -> dict[str, Any]:
    return {"name": "t", "input_schema": {"type": "object", "properties": {"a": {"type": "string"}}}, **fields}


@pytest.mark.parametrize(
    ("kind", "config", "tool", "code"),
    [
        ("http", {"base_url": "ftp://x"}, _tool(http={"method": "GET", "path": "/"}), "invalid_config"),
        ("http", {"base_url": "http://x/v1?key=k"}, _tool(http={"method": "GET", "path": "/"}), "invalid_config"),
        ("http", {"base_url": "http://x/\x01"}, _tool(http={"method": "GET", "path": "/"}), "invalid_config"),
        ("http", {"base_url": "http://x"}, _tool(), "invalid_http_spec"),
        ("http", {"base_url": "http://x"}, _tool(http={"method": "TRACE", "path": "/"}), "invalid_http_spec"),
        ("http", {"base_url": "http://x"}, _tool(http={"method": "GET", "path": "/", "query": ["b"]}), "unknown_http_parameter"),
        ("http", {"base_url": "http://x"}, _tool(http={"method": "GET", "path": "/{a}"}), "unknown_http_parameter"),
        ("mcp", {"transport": "carrier_pigeon"}, _tool(), "invalid_config"),
        ("mcp", {"transport": "stdio"}, _tool(), "invalid_config"),
        (
            "mcp",
            {"transport": "streamable_http", "url": "http://x/mcp"},
            _tool(input_schema={"type": "array"}),
            "invalid_json_schema",
        ),
        ("mcp", {"transport": "stdio", "command": "x"}, _tool(output_schema={"type": 5}), "invalid_json_schema"),
        ("mcp", {"transport": "stdio", "command": "x"}, _tool(name="class"), "invalid_tool_name"),
        ("mcp", {"transport": "stdio", "command": "x"}, _tool(allowed_callers=["robots"]), "invalid_allowed_callers"),
        ("mcp", {"transport": "stdio", "command": "x", "env": {"T": "{{secrets.T}}"}}, _tool(), "unknown_secret"),
    ],
)
def test_definition_checks(kind: str, config: dict[str, Any], tool: dict[str, Any], code: str) -> None:
    errors = toolset_errors(key="ok", kind=kind, config=config, secrets={}, tools=[tool])
    assert [e.code for e in errors][:1] == [code], errors


def test_key_and_duplicate_checks() -> None:
    config = {"transport": "stdio", "command": "x"}
    assert toolset_errors(key="search", kind="mcp", config=config, secrets={}, tools=[])[0].code == "invalid_key"
    assert toolset_errors(key="_x", kind="mcp", config=config, secrets={}, tools=[])[0].code == "invalid_key"
    twice = toolset_errors(key="ok", kind="mcp", config=config, secrets={}, tools=[_tool(), _tool()])
    assert [e.code for e in twice] == ["duplicate_tool_name"]
    assert toolset_errors(key="ok", kind="mcp", config=config, secrets={}, tools=[_tool()]) == []


def test_typed_returns_and_shapes() -> None:
    schema = {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "items": {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]},
            },
            "next": {"type": ["string", "null"]},
            "meta": {"type": "object"},
        },
        "required": ["items"],
    }
    types = _TypeDefs(reserved={"Github"})
    assert types.annotation(schema, "ListIssuesResult") == "ListIssuesResult"
    assert types.lines == [
        'ListIssuesResultItemsItem = TypedDict("ListIssuesResultItemsItem", {"id": Required[int]}, total=False)',
        'ListIssuesResult = TypedDict("ListIssuesResult", {"items": Required[list[ListIssuesResultItemsItem]], '
        '"meta": dict[str, Any], "next": str | None}, total=False)',
    ]
    namespace: dict[str, Any] = {}
    exec("from typing import Any, Required, TypedDict\n" + "\n".join(types.lines), namespace)
    assert namespace["ListIssuesResult"].__required_keys__ == frozenset({"items"})
    assert shape(schema) == "{items: list[{id: int}], meta?: dict, next?: str | None}"
    assert summary("Add two numbers. Then more.\n\nDetails.") == "Add two numbers"
    assert summary("word " * 30, 20) == "word word word word…"


def _types_over_options(depth: int, options: int) -> dict[str, Any]:
    """A schema whose every level lists six types and ``options`` anyOf options, ``depth`` deep."""
    level: dict[str, Any] = {"type": ["string", "number", "integer", "boolean", "array", "object", "null"]}
    if depth:
        level["anyOf"] = [_types_over_options(depth - 1, options) for _ in range(options)]
    return level


class _Looked(set[str]):
    """A set of names that counts how many were looked up in it (``in``)."""

    looked = 0

    def __contains__(self, name: object) -> bool:
        self.looked += 1
        return super().__contains__(name)


def test_shapes_and_typed_returns_take_time_in_proportion_to_the_schema() -> None:
    # Each type of a list rendered the level's anyOf again: the work multiplied by 6 to 7 at each
    # level. A client tool's output schema of 10 KB held the exec worker building its SDK (or the
    # web answering POST /ptc/context) for 23 s, one of 256 KB (its limit) for hours; an input
    # schema of 30 KB its signature for 4 s.
    started = time.monotonic()
    assert _TypeDefs(reserved=set()).annotation(_types_over_options(6, 2), "R") == "Any"
    assert shape(_types_over_options(5, 3)) == "Any"
    assert time.monotonic() - started < 1
    # Each TypedDict named after the same tool (the options of one anyOf) looked for a free name
    # from the first: 6,000 of them (160 KB) took 4 s, 18 million names tried. Counted, not timed:
    # a name or two tried for each.
    types = _TypeDefs(reserved=set())
    types._taken = _Looked(types._taken)
    assert types.annotation({"anyOf": [{"properties": {"a": {}}}] * 6000}, "R").startswith("R | R2 | R3 | ")
    assert types.lines[-1].startswith('R6000 = TypedDict("R6000"')
    looked = types._taken.looked
    assert looked <= 2 * 6000, looked
    one_type = {"type": ["object", "null"], "anyOf": [{"properties": {"a": {"type": "integer"}}}, {"type": "string"}]}
    assert _TypeDefs(reserved=set()).annotation(one_type, "R") == "R | str | None"
    assert shape(one_type) == "{a?: int} | str"


def _toolset(key: str, n: int) -> tuple[Toolset, list[Tool]]:
    toolset = Toolset(key=key, name=key.title(), kind="mcp")
    schema = {"type": "object", "properties": {"owner": {"type": "string"}, "page": {"type": "integer"}}, "required": ["owner"]}
    tools = [Tool(toolset=toolset, name=f"tool_{i}", description=f"Does thing {i}. More.", input_schema=schema) for i in range(n)]
    return toolset, tools


def test_the_reference_is_as_detailed_as_its_budget_allows() -> None:
    small = [_toolset("small", 3)]
    context = ptc_context_build(fmt="anthropic", enabled=True, sequential=False, discovery=False, direct=[], per_toolset=small)
    assert "tool_0(owner: str, page?: int) - Does thing 0" in context["tools"][-1]["description"]
    big = [_toolset("big", 400)]
    context = ptc_context_build(fmt="anthropic", enabled=True, sequential=False, discovery=False, direct=[], per_toolset=big)
    reference = context["tools"][-1]["description"]
    # Schemas this small can't be cut to 10%: the tersest level is used, names and required parameters still there.
    assert context["stats"]["compact_chars"] > 0.10 * context["stats"]["schema_chars"]
    assert "\ntool_399(owner, …)\n" in reference + "\n"
    assert compact_reference(big, LEVELS[0]).count("\n") == compact_reference(big, Level(True, "ellipsis", 0)).count("\n")


def test_provider_names_are_qualified_only_when_two_toolsets_share_one() -> None:
    (a, [a0, _, _]), (b, [b0]) = _toolset("alpha", 3), _toolset("beta", 1)
    named = provider_tools("openai", [(a, a0), (b, b0)])
    assert [t["name"] for t in named] == ["alpha__tool_0", "beta__tool_0"]
    assert json.dumps(named[0]).startswith('{"type": "function", "name": "alpha__tool_0"')
