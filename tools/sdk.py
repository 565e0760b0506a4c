"""The generated ``ptc_tools`` package: one module per toolset, one class per module.

``sdk_build`` turns toolset definitions into files plus a content hash; the same definitions give
the same hash. ``sdk_cached`` keeps recent builds by hash; a job's build travels to its sandbox with
the job.
"""

import functools
import hashlib
import json
import keyword
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ptcproject.kept import Kept
from tools.classification import direct_only_tools, tool_is_ptc
from tools.models import Tool, Toolset

GENERATOR_VERSION = "3"  # 3: ptc_tools.tools, the flat style
_RUNTIME_DIR = Path(__file__).parent / "sdk_runtime"
_JSON_TYPES = {
    "string": "str",
    "integer": "int",
    "number": "float",
    "boolean": "bool",
    "array": "list",
    "object": "dict",
    "null": "None",
}

_INIT = '''"""Tools you can call from code. Each toolset is a module: ``from ptc_tools.demo import Demo``.

Call a tool with keyword arguments: ``Demo.add(a=1, b=2)``; from asyncio: ``await Demo.add.aio(a=1, b=2)``.
A failed call raises ``ToolError`` with ``.tool``, ``.code``, ``.call_id`` and ``.message``.
Look tools up from code: ``print(describe("demo.add"))``, ``search("product catalog")``.
Or by bare name, whatever the toolset: ``tools.add(a=1, b=2)`` (the seed's flat style).
"""

from ptc_tools import _runtime
from ptc_tools._discovery import describe, search
from ptc_tools._flat import tools
from ptc_tools._runtime import ToolError

__path__ += [path for path in _runtime.sdk_paths if path not in __path__]  # the job's SDK, after a reload too
__all__ = ["ToolError", "describe", "search", "tools"]
'''


@dataclass(frozen=True)
class Sdk:
    hash: str
    files: dict[str, str]
    docs: dict[str, str]


def class_name(key: str) -> str:
    """``demo`` → ``Demo``, ``web_search`` → ``WebSearch``."""
    return "".join(part[:1].upper() + part[1:] for part in key.split("_") if part) or "Toolset"


def json_type(schema: Any) -> str:
    """Return the Python type name for a JSON Schema, ``Any`` where it has none or several."""
    if not isinstance(schema, dict):
        return "Any"
    kind = schema.get("type")
    if isinstance(kind, str):
        return _JSON_TYPES.get(kind, "Any")
    return "Any"


def _json_type_label(schema: Any) -> str:
    """Return the schema's type as the compact signature shows it (``number``, ``str``, ``list``)."""
    if isinstance(schema, dict) and schema.get("type") == "number":
        return "number"
    return json_type(schema)


def parameters(schema: dict[str, Any] | None) -> tuple[list[str], list[str], dict[str, Any]]:
    """Return a tool's required and optional parameter names, and their schemas.

    Required ones come in the order of ``required``, optional ones alphabetically: PostgreSQL's
    jsonb does not keep key order, and the SDK must read the same on every database.
    """
    schema = schema or {}
    properties = schema.get("properties") or {}
    if not isinstance(properties, dict):
        properties = {}
    required = [n for n in dict.fromkeys(schema.get("required") or []) if n in properties]
    optional = sorted(n for n in properties if n not in required)
    return required, optional, properties


def tool_signature(tool: Tool) -> str:
    """Return the compact one-line form, e.g. ``catalog_search(query: str, limit?: int) -> list``."""
    required, optional, properties = parameters(tool.input_schema)
    params = [f"{n}: {_json_type_label(properties[n])}" for n in required]
    params += [f"{n}?: {_json_type_label(properties[n])}" for n in optional]
    returns = _json_type_label(tool.output_schema) if tool.output_schema else "Any"
    return f"{tool.name}({', '.join(params)}) -> {returns}"


def summary(description: str, limit: int = 80) -> str:
    """Return the first sentence of ``description``, cut at a word to at most ``limit`` characters."""
    text = " ".join(description.strip().split("\n\n")[0].split())
    text = re.split(r"(?<=[.!?])\s", text, maxsplit=1)[0].rstrip(".")
    if len(text) > limit:
        cut = text[: limit - 1]
        if text[limit - 1] != " ":  # mid-word: drop the partial word
            cut = cut.rsplit(" ", 1)[0]
        text = cut.rstrip(" ,;:") + "…"
    return text


def shape(schema: Any, depth: int = 0) -> str:
    """Return the compact shape of a JSON value: ``list[{id: str, price?: float}]``."""
    if not isinstance(schema, dict) or depth > 4:
        return "Any"
    kinds = schema.get("type")
    # Its options before its types: each type of a list rendered them again, the work multiplied
    # by up to 7 at each level (a 30 KB schema took 4 s, one of the limit's size hours).
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list) and schema[key]:
            return " | ".join(dict.fromkeys(shape(option, depth + 1) for option in schema[key]))
    if isinstance(kinds, list):
        return " | ".join(shape({**schema, "type": k}, depth) for k in kinds) or "Any"
    if kinds == "array":
        return f"list[{shape(schema.get('items'), depth + 1)}]" if isinstance(schema.get("items"), dict) else "list"
    properties = schema.get("properties")
    if (kinds == "object" or kinds is None) and isinstance(properties, dict) and properties:
        required = set(schema.get("required") or [])
        fields = [f"{k}{'' if k in required else '?'}: {shape(properties[k], depth + 1)}" for k in sorted(properties)]
        return "{" + ", ".join(fields) + "}"
    return _json_type_label(schema) if kinds else "Any"


class _TypeDefs:
    """The TypedDicts one module's typed returns need, named after their tools (``SleepResult``)."""

    def __init__(self, reserved: set[str]) -> None:
        self.lines: list[str] = []
        self._taken = set(reserved) | {"Any", "Required", "TypedDict"}
        # The number each hint's next name is looked for from: names are only ever taken, so those
        # below it still are. From 2 each time, the k-th of one hint tried k names (6,000 took 4 s).
        self._next: dict[str, int] = {}

    def _name(self, hint: str) -> str:
        name, n = hint, self._next.get(hint, 2)
        while name in self._taken:
            name, n = f"{hint}{n}", n + 1
        self._next[hint] = n
        self._taken.add(name)
        return name

    def annotation(self, schema: Any, hint: str, depth: int = 0) -> str:
        """Return a Python annotation for ``schema``, defining the TypedDicts it needs first."""
        if not isinstance(schema, dict) or depth > 6:
            return "Any"
        kinds = schema.get("type")
        if isinstance(kinds, list):
            # Rendered for its one type only: each type of a list rendered the rest of the schema
            # again, the work multiplied at each level (a 10 KB output schema took 23 s).
            types = [k for k in kinds if k != "null"]
            one = self.annotation({**schema, "type": types[0]}, hint, depth) if len(types) == 1 else "Any"
            return "Any" if one == "Any" else f"{one} | None" if "null" in kinds else one
        for key in ("anyOf", "oneOf"):
            if isinstance(schema.get(key), list) and schema[key]:
                options = list(dict.fromkeys(self.annotation(o, hint, depth + 1) for o in schema[key]))
                return "Any" if "Any" in options else " | ".join(options)
        if kinds == "array":
            return f"list[{self.annotation(schema.get('items'), hint + 'Item', depth + 1)}]"
        properties = schema.get("properties")
        if kinds == "object" or (kinds is None and isinstance(properties, dict)):
            if not isinstance(properties, dict) or not properties:
                return "dict[str, Any]"
            name = self._name(hint)
            required = set(schema.get("required") or [])
            fields = []
            for key in sorted(properties):
                sub = self.annotation(properties[key], name + class_name(re.sub(r"\W", "_", key)), depth + 1)
                fields.append(f"{json.dumps(key)}: {f'Required[{sub}]' if key in required else sub}")
            self.lines.append(f"{name} = TypedDict({json.dumps(name)}, {{{', '.join(fields)}}}, total=False)")
            return name
        return _JSON_TYPES.get(kinds, "Any") if isinstance(kinds, str) else "Any"


def _doc_literal(text: str) -> str:
    """Return ``text`` safe inside a triple-quoted string: it comes from admins and MCP servers."""
    return text.replace("\\", "\\\\").replace('"""', '\\"\\"\\"')


def parameter_docs(tool: Tool) -> list[str]:
    """Return one line per parameter: ``limit (int; optional; default 10): how many``."""
    required, optional, properties = parameters(tool.input_schema)
    lines = []
    for name in required + optional:
        prop = properties[name] if isinstance(properties[name], dict) else {}
        bits = [_json_type_label(prop), "required" if name in required else "optional"]
        if "enum" in prop:
            bits.append("one of " + ", ".join(json.dumps(v) for v in prop["enum"]))
        if "default" in prop:
            bits.append(f"default {json.dumps(prop['default'])}")
        desc = f": {' '.join(str(prop['description']).split())}" if prop.get("description") else ""
        lines.append(f"{name} ({'; '.join(bits)}){desc}")
    return lines


def _docstring(tool: Tool) -> str:
    lines = [tool_signature(tool), ""]
    if tool.description:
        lines += [tool.description.strip(), ""]
    params = parameter_docs(tool)
    if params:
        lines += ["Args:", *(f"    {line}" for line in params)]
    if tool.output_schema:
        lines += ["", "Returns:", f"    {shape(tool.output_schema)}"]
    return textwrap.indent(_doc_literal("\n".join(lines)), "    ").strip()


def _tool_source(toolset_key: str, tool: Tool, types: _TypeDefs) -> str:
    required, optional, properties = parameters(tool.input_schema)
    names_ok = all(n.isidentifier() and not keyword.iskeyword(n) and not n.startswith("_") for n in properties)
    returns = types.annotation(tool.output_schema, class_name(tool.name) + "Result") if tool.output_schema else "Any"
    fn = f"_{tool.name}"
    if names_ok:
        params = [f"{n}: {json_type(properties[n])}" for n in required]
        params += [f"{n}: {json_type(properties[n])} = _rt.UNSET" for n in optional]
        signature = f"*, {', '.join(params)}" if params else ""
        passed = f"_rt.args({', '.join(f'{n}={n}' for n in required + optional)})"
    else:  # parameter names Python can't spell: take them as **kwargs
        signature, passed = "**kwargs: Any", "kwargs"
    target = f"{json.dumps(toolset_key)}, {json.dumps(tool.name)}"
    return (
        f"def {fn}({signature}) -> {returns}:\n"
        f'    """{_docstring(tool)}\n    """\n'
        f"    return _rt.call({target}, {passed})\n\n\n"
        f"async def {fn}_aio({signature}) -> {returns}:\n"
        f"    return await _rt.acall({target}, {passed})\n\n\n"
        f"{fn}.aio = {fn}_aio  # type: ignore[attr-defined]\n"
    )


def _module_source(toolset: Toolset, tools: list[Tool]) -> str:
    cls = class_name(toolset.key)
    types = _TypeDefs(reserved={cls})
    functions = [_tool_source(toolset.key, t, types) + "\n" for t in tools]
    header = f'"""{_doc_literal(toolset.name)}: {_doc_literal(toolset.description)}"""'
    parts = [header, "", "from typing import Any, Required, TypedDict", "", "from ptc_tools import _runtime as _rt", "", ""]
    if types.lines:
        parts += ["# The shapes of the tools' results, from their output schemas.", *types.lines, "", ""]
    parts += functions
    members = "\n".join(f"    {t.name} = staticmethod(_{t.name})" for t in tools) or "    pass"
    parts.append(f'class {cls}:\n    """{_doc_literal(toolset.description or toolset.name)}"""\n\n{members}\n')
    parts.append(f'\n__all__ = ["{cls}"]\n')
    return "\n".join(parts)


def _toolset_doc(toolset: Toolset, tools: list[Tool]) -> str:
    cls = class_name(toolset.key)
    lines = [f"# {toolset.name} (`from ptc_tools.{toolset.key} import {cls}`)", ""]
    if toolset.description:
        lines += [toolset.description, ""]
    for tool in tools:
        returns = f" Returns `{shape(tool.output_schema)}`." if tool.output_schema else ""
        effect = "read-only" if tool.read_only else "side effects"
        text = summary(tool.description)
        lines.append(f"- `{cls}.{tool_signature(tool)}` ({effect}){f': {text}.' if text else ''}{returns}")
    return "\n".join(lines) + "\n"


def _catalog(per_toolset: list[tuple[Toolset, list[Tool]]]) -> str:
    """Return ``_catalog.json``: what ``ptc_tools.describe`` and ``search`` read in the sandbox.

    Definitions only: no config, no secrets, no prices.
    """
    tools = [catalog_entry(toolset, tool) for toolset, tools in per_toolset for tool in tools]
    return json.dumps({"tools": tools}, sort_keys=True, ensure_ascii=False)


def catalog_entry(toolset: Toolset, tool: Tool) -> dict[str, Any]:
    """Return one tool's definition and docs, as ``ptc_tools.describe`` gives them in the sandbox
    (and the MCP server's ``describe_tool`` outside it). Definitions only: no config, no secrets, no prices."""
    return {
        "toolset": toolset.key,
        "class": class_name(toolset.key),
        "name": tool.name,
        "signature": tool_signature(tool),
        "summary": summary(tool.description),
        "description": tool.description,
        "parameters": parameter_docs(tool),
        "returns": shape(tool.output_schema) if tool.output_schema else "Any",
        "read_only": tool.read_only,
        "input_schema": tool.input_schema,
        "output_schema": tool.output_schema,
    }


@functools.cache
def sdk_base_files() -> dict[str, str]:
    """Return the part of every SDK that no toolset changes: the package and its runtime. A warm
    sandbox has it imported before its job comes; the job brings the rest (``sdk_job_files``)."""
    return {
        "ptc_tools/__init__.py": _INIT,
        "ptc_tools/_runtime.py": (_RUNTIME_DIR / "runtime.py").read_text(),
        "ptc_tools/_protocol.py": (_RUNTIME_DIR / "protocol.py").read_text(),
        "ptc_tools/_discovery.py": (_RUNTIME_DIR / "discovery.py").read_text(),
        "ptc_tools/_flat.py": (_RUNTIME_DIR / "flat.py").read_text(),
    }


def sdk_job_files(sdk: Sdk) -> dict[str, str]:
    """Return the files of ``sdk`` that its toolsets make: what travels to the sandbox with a job."""
    base = sdk_base_files()
    return {name: content for name, content in sdk.files.items() if name not in base}


def ptc_tools_of(toolsets: list[Toolset], direct_only: frozenset[str] | None = None) -> list[tuple[Toolset, list[Tool]]]:
    """Return each toolset (tools prefetched) with its enabled PTC tools, both sorted: the SDK's input."""
    direct_only = direct_only_tools() if direct_only is None else direct_only
    return [
        (toolset, ptc_tools_in(toolset=toolset, tools=list(toolset.tools.all()), direct_only=direct_only))
        for toolset in sorted(toolsets, key=lambda t: t.key)
    ]


def ptc_tools_in(*, toolset: Toolset, tools: list[Tool], direct_only: frozenset[str]) -> list[Tool]:
    """Return the enabled PTC tools among ``tools``, by name. Direct tools never enter the SDK."""
    found = (t for t in tools if t.enabled and tool_is_ptc(tool=t, toolset=toolset, direct_only=direct_only))
    return sorted(found, key=lambda t: t.name)


def _hash(per_toolset: list[tuple[Toolset, list[Tool]]]) -> str:
    definitions = [
        [ts.key, ts.name, ts.description, [[t.name, t.description, t.input_schema, t.output_schema, t.read_only] for t in tools]]
        for ts, tools in per_toolset
    ]
    digest = hashlib.sha256(GENERATOR_VERSION.encode())
    digest.update(json.dumps(definitions, sort_keys=True, separators=(",", ":")).encode())
    for name, content in sorted(sdk_base_files().items()):
        digest.update(name.encode() + content.encode())
    return digest.hexdigest()


def sdk_hash(*, toolsets: list[Toolset]) -> str:
    """Return the content hash of the SDK for ``toolsets`` without generating it."""
    return sdk_hash_of(ptc_tools_of(toolsets))


def sdk_hash_of(per_toolset: list[tuple[Toolset, list[Tool]]]) -> str:
    """Return the content hash of the SDK for ``ptc_tools_of``'s answer."""
    return _hash(per_toolset)


def sdk_build(*, toolsets: list[Toolset]) -> Sdk:
    """Return the SDK for ``toolsets`` (with their tools prefetched). Direct tools are left out."""
    return sdk_build_of(ptc_tools_of(toolsets))


def sdk_build_of(per_toolset: list[tuple[Toolset, list[Tool]]]) -> Sdk:
    """Return the SDK for ``ptc_tools_of``'s answer: works on unsaved rows too (the benchmark's)."""
    files = {**sdk_base_files(), "ptc_tools/_catalog.json": _catalog(per_toolset)}
    docs = {}
    for toolset, tools in per_toolset:
        files[f"ptc_tools/{toolset.key}.py"] = _module_source(toolset, tools)
        docs[toolset.key] = _toolset_doc(toolset, tools)
    return Sdk(hash=_hash(per_toolset), files=files, docs=docs)


# Builds by hash, for GET /sdk: the same definitions are asked for again and again, and a build of a
# large toolset (GitHub's 114 tools) costs tens of milliseconds.
_BUILDS: Kept[str, Sdk] = Kept(32)


def sdk_cached(
    *, toolsets: list[Toolset], extra: list[tuple[Toolset, list[Tool]]] | None = None, direct_only: frozenset[str] | None = None
) -> Sdk:
    """Return the SDK for ``toolsets``, built only if its hash is new to this process.

    ``extra`` are modules of unsaved rows to add, as ``ptc_tools_of`` gives them: a job's client
    tools. ``direct_only`` is the policy's, when the caller has read it already.
    """
    per_toolset = ptc_tools_of(toolsets, direct_only) + list(extra or [])
    digest = sdk_hash_of(per_toolset)
    hit = _BUILDS.get(digest)
    if hit is not None:
        return hit
    sdk = sdk_build_of(per_toolset)
    _BUILDS.put(digest, sdk)
    return sdk
