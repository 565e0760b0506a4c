"""Checks on toolset definitions, shared by the API's services and the admin's forms.

Each check returns ``FieldError``s rather than raising, so one answer can name every problem; the
caller decides how to show them. Paths read like ``tools[2].input_schema``.
"""

import keyword
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httpx
import jsonschema
import referencing
import referencing.exceptions
import referencing.jsonschema

from tools.arguments import PATTERN_SIZE, keyword_values, schema_pattern_problem
from tools.kinds.http import METHODS, path_params
from tools.kinds.mcp import TRANSPORTS
from tools.models import Tool, Toolset
from tools.secret_refs import headers_problem, secret_names_used

# Names the generated package itself uses: ``ptc_tools.describe`` is a function, not a toolset module.
RESERVED_KEYS = frozenset({"describe", "search", "ToolError"})
CALLERS = {c.value for c in Tool.Caller}


@dataclass(frozen=True)
class FieldError:
    path: str
    code: str
    message: str


def identifier_problem(name: Any) -> str | None:
    """Return why ``name`` can't be a Python name for a module or method, or None if it can."""
    if not isinstance(name, str) or not name.isidentifier():
        return f"{name!r} is not a Python identifier (letters, digits and underscores, not starting with a digit)"
    if keyword.iskeyword(name):
        return f"'{name}' is a Python keyword"
    if name.startswith("_"):
        return f"'{name}' starts with an underscore, which the SDK keeps for itself"
    return None


def _unresolved_ref(schema: dict[str, Any]) -> str | None:
    """Return a ``$ref`` within the schema (``#...``) that names nothing in it, if any. One to
    elsewhere is never fetched: its calls fail with invalid_arguments (tools/arguments.py)."""
    resource = referencing.jsonschema.specification_with(
        schema.get("$schema", ""), default=referencing.jsonschema.DRAFT202012
    ).create_resource(schema)
    resolver = referencing.Registry().with_resource(uri="", resource=resource).resolver()
    for ref in keyword_values(schema, "$ref"):
        if isinstance(ref, str) and ref.startswith("#"):
            try:
                resolver.lookup(ref)
            except referencing.exceptions.Unresolvable:
                return ref
    return None


def schema_errors(schema: Any, *, path: str, object_root: bool) -> list[FieldError]:
    """Return what is wrong with ``schema`` as a JSON Schema (an object schema if ``object_root``)."""
    if not isinstance(schema, dict):
        return [FieldError(path, "invalid_json_schema", "must be a JSON Schema object")]
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path)
        return [
            FieldError(path, "invalid_json_schema", f"not a valid JSON Schema{f' at {where}' if where else ''}: {exc.message}")
        ]
    except (OverflowError, RecursionError) as exc:
        # A ``pattern`` is compiled as the schema is checked (its format is regex): Python's re
        # raises these, not re.error, for a repeat count too large (a{99999999999}) or groups
        # nested past its parser's recursion.
        return [FieldError(path, "invalid_json_schema", f"not a valid JSON Schema: a pattern in it can't be compiled ({exc})")]
    if (unresolved := _unresolved_ref(schema)) is not None:
        return [FieldError(path, "invalid_json_schema", f"$ref {unresolved!r} names nothing in the schema")]
    if (why := schema_pattern_problem(schema)) is not None:
        # Every call of the tool would be refused checking it (tools/arguments.py): refused here.
        too_large = f"its counted repeats written out, nested ones multiplied, are over {PATTERN_SIZE:,} items"
        return [FieldError(path, "invalid_json_schema", f"the schema {why}: {too_large}; make them smaller")]
    if object_root:
        if schema.get("type", "object") != "object":
            return [FieldError(path, "invalid_json_schema", 'must describe keyword arguments: {"type": "object", ...}')]
        if not isinstance(schema.get("properties", {}), dict):
            return [FieldError(path, "invalid_json_schema", "properties must be an object")]
    return []


def _http_spec_errors(spec: Any, schema: Any, *, path: str) -> list[FieldError]:
    if not isinstance(spec, dict):
        return [FieldError(path, "invalid_http_spec", 'must be {"method": "GET", "path": "/...", "query": [...]}')]
    errors = []
    if str(spec.get("method", "")).upper() not in METHODS:
        errors.append(FieldError(f"{path}.method", "invalid_http_spec", f"must be one of {', '.join(METHODS)}"))
    route = spec.get("path")
    if not isinstance(route, str) or not route.startswith("/"):
        errors.append(FieldError(f"{path}.path", "invalid_http_spec", "must be a path starting with '/'"))
        route = ""
    query = spec.get("query") or []
    if not isinstance(query, list) or not all(isinstance(q, str) for q in query):
        errors.append(FieldError(f"{path}.query", "invalid_http_spec", "must be a list of parameter names"))
        query = []
    properties = (schema or {}).get("properties") or {} if isinstance(schema, dict) else {}
    required = set((schema or {}).get("required") or []) if isinstance(schema, dict) else set()
    for name in path_params(route):
        if name not in properties:
            errors.append(
                FieldError(f"{path}.path", "unknown_http_parameter", f"'{{{name}}}' is not a parameter in input_schema")
            )
        elif name not in required:
            errors.append(
                FieldError(f"{path}.path", "unknown_http_parameter", f"'{{{name}}}' is in the path, so it must be required")
            )
    for name in query:
        if name not in properties:
            errors.append(FieldError(f"{path}.query", "unknown_http_parameter", f"'{name}' is not a parameter in input_schema"))
    extra = set(spec) - {"method", "path", "query"}
    if extra:
        errors.append(FieldError(path, "invalid_http_spec", f"unknown keys: {', '.join(sorted(extra))}"))
    return errors


# A client tool's call waits on the job's caller, who runs it or not: nothing runs here for an
# approval to hold back, and the flag would be kept and never acted on.
CLIENT_NOT_GATED = "a client tool is run by the job's caller, not here: an approval can't gate it"


def tool_errors(tool: Mapping[str, Any], *, kind: str, path: str) -> list[FieldError]:
    """Return what is wrong with one tool definition of a toolset of ``kind``."""
    errors = []
    problem = identifier_problem(tool.get("name"))
    if problem:
        errors.append(FieldError(f"{path}.name", "invalid_tool_name", problem))
    errors += schema_errors(tool.get("input_schema", {}), path=f"{path}.input_schema", object_root=True)
    if tool.get("output_schema") is not None:
        errors += schema_errors(tool["output_schema"], path=f"{path}.output_schema", object_root=False)
    callers = tool.get("allowed_callers") or []
    if not isinstance(callers, list) or not set(callers) <= CALLERS:
        errors.append(
            FieldError(
                f"{path}.allowed_callers", "invalid_allowed_callers", f"values must be among: {', '.join(sorted(CALLERS))}"
            )
        )
    spec = tool.get("http")
    if kind == Toolset.Kind.HTTP:
        if spec is None:
            errors.append(FieldError(f"{path}.http", "invalid_http_spec", 'an http tool needs {"method", "path", "query"}'))
        else:
            errors += _http_spec_errors(spec, tool.get("input_schema"), path=f"{path}.http")
    elif spec is not None:
        errors.append(FieldError(f"{path}.http", "invalid_http_spec", f"only http toolsets' tools take an http spec, not {kind}"))
    if kind == Toolset.Kind.CLIENT and tool.get("requires_approval"):
        errors.append(FieldError(f"{path}.requires_approval", "validation_error", CLIENT_NOT_GATED))
    return errors


def _url_problem(url: Any, *, base: bool = False) -> str | None:
    """Why ``url`` can't be a server's http(s) URL, as httpx reads it, or None. A ``base`` (an http
    toolset's, which each tool's path is added to) has no query or fragment."""
    if not isinstance(url, str):
        return "must be an http(s) URL"
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as exc:
        return f"is not a URL a request can be sent to: {exc}"
    if parsed.scheme not in ("http", "https") or not parsed.host:
        return "must be an http(s) URL"
    if base and (parsed.query or parsed.fragment):
        return "can't have a query or a fragment: each tool's path is added to it, and the query is the tool's"
    return None


def _str_map_problem(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        return "must be an object of strings"
    return None


# Where each kind fills in ``{{secrets.NAME}}`` (tools/kinds/http.py, tools/kinds/mcp.py).
_SECRETS_FILLED_IN: dict[str, tuple[str, ...]] = {Toolset.Kind.HTTP: ("headers",), Toolset.Kind.MCP: ("env", "headers")}


def config_errors(config: Any, *, kind: str, secrets: Mapping[str, Any]) -> list[FieldError]:
    """Return what is wrong with a toolset's ``config`` for its ``kind`` with its ``secrets`` (by
    name), and secrets it names but lacks."""
    if not isinstance(config, dict):
        return [FieldError("config", "invalid_config", "must be an object")]
    errors = []

    def check(name: str, problem: str | None) -> None:
        if problem:
            errors.append(FieldError(f"config.{name}", "invalid_config", problem))

    for name in ("timeout", "init_timeout"):
        seconds = config.get(name)
        if seconds is not None and (isinstance(seconds, bool) or not isinstance(seconds, int | float) or seconds <= 0):
            check(name, "must be a positive number of seconds")
    if kind == Toolset.Kind.HTTP:
        check("base_url", _url_problem(config.get("base_url"), base=True))
        check("headers", _str_map_problem(config.get("headers")) or headers_problem(config.get("headers"), secrets))
    elif kind == Toolset.Kind.MCP:
        transport = config.get("transport")
        if transport not in TRANSPORTS:
            check("transport", f"must be one of {', '.join(TRANSPORTS)}")
        elif transport == "stdio":
            if not isinstance(config.get("command"), str) or not config["command"]:
                check("command", "the command that starts the server is required")
            args = config.get("args", [])
            if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
                check("args", "must be a list of strings")
            check("env", _str_map_problem(config.get("env")))
        else:
            check("url", _url_problem(config.get("url")))
            check("headers", _str_map_problem(config.get("headers")) or headers_problem(config.get("headers"), secrets))
    # Secrets are filled in only where the kind renders them; a reference anywhere else would be
    # sent as it is written, {{secrets.NAME}}, in a URL or a command line.
    filled = _SECRETS_FILLED_IN.get(kind, ())
    for name in sorted(str(n) for n in config):
        if name not in filled and secret_names_used(config[name]):
            where = f"only in {' and '.join(filled)}" if filled else f"in no field of a {kind} toolset"
            check(name, f"names a secret, but secrets are filled in {where}: here it would be sent as it is written")
    missing = sorted(secret_names_used(config) - set(secrets))
    if missing:
        errors.append(
            FieldError(
                "config", "unknown_secret", f"uses {{{{secrets.NAME}}}} for secrets that are not set: {', '.join(missing)}"
            )
        )
    return errors


def toolset_errors(
    *,
    key: str,
    kind: str,
    config: Any,
    secrets: Mapping[str, Any],
    tools: list[Mapping[str, Any]],
    requires_approval: bool = False,
) -> list[FieldError]:
    """Return every problem with a whole toolset definition; an empty list means it may be saved."""
    errors = []
    problem = identifier_problem(key)
    if problem:
        errors.append(FieldError("key", "invalid_key", problem))
    elif key in RESERVED_KEYS:
        errors.append(FieldError("key", "invalid_key", f"'{key}' is a name the SDK package uses itself"))
    if kind == Toolset.Kind.CLIENT and requires_approval:
        errors.append(FieldError("requires_approval", "validation_error", CLIENT_NOT_GATED))
    errors += config_errors(config, kind=kind, secrets=secrets)
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        errors += tool_errors(tool, kind=kind, path=f"tools[{i}]")
        name = tool.get("name")
        if isinstance(name, str) and name in seen:
            errors.append(FieldError(f"tools[{i}].name", "duplicate_tool_name", f"'{name}' is defined twice"))
        seen.add(str(name))
    return errors
