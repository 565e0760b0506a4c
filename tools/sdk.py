"""The generated ``ptc_tools`` package: one module per toolset, one class per module.

``sdk_build`` turns toolset definitions into files plus a content hash; the same definitions give
the same hash. ``sdk_materialize`` writes a build to disk once per hash, for the sandbox to mount.
"""

import functools
import hashlib
import json
import keyword
import os
import shutil
import tempfile
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from django.conf import settings

from tools.models import Tool, Toolset
from tools.selectors import direct_only_tools, tool_is_ptc

GENERATOR_VERSION = "1"
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
"""

from ptc_tools._runtime import ToolError

__all__ = ["ToolError"]
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


def _docstring(tool: Tool) -> str:
    required, optional, properties = parameters(tool.input_schema)
    lines = [tool_signature(tool), ""]
    if tool.description:
        lines += [tool.description.strip(), ""]
    if properties:
        lines.append("Args:")
        for name in required + optional:
            prop = properties[name] if isinstance(properties[name], dict) else {}
            bits = [_json_type_label(prop), "required" if name in required else "optional"]
            if "enum" in prop:
                bits.append("one of " + ", ".join(json.dumps(v) for v in prop["enum"]))
            if "default" in prop:
                bits.append(f"default {json.dumps(prop['default'])}")
            desc = f": {prop['description']}" if prop.get("description") else ""
            lines.append(f"    {name} ({'; '.join(bits)}){desc}")
    if tool.output_schema:
        lines += ["", "Returns:", f"    {json.dumps(tool.output_schema, sort_keys=True)}"]
    text = "\n".join(lines).replace("\\", "\\\\").replace('"""', '\\"\\"\\"')
    return textwrap.indent(text, "    ").strip()


def _tool_source(toolset_key: str, tool: Tool) -> str:
    required, optional, properties = parameters(tool.input_schema)
    names_ok = all(n.isidentifier() and not keyword.iskeyword(n) and not n.startswith("_") for n in properties)
    returns = json_type(tool.output_schema)
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
    header = f'"""{toolset.name}: {toolset.description}"""'.replace("\\", "\\\\")
    parts = [header, "", "from typing import Any", "", "from ptc_tools import _runtime as _rt", "", ""]
    parts += [_tool_source(toolset.key, t) + "\n" for t in tools]
    members = "\n".join(f"    {t.name} = staticmethod(_{t.name})" for t in tools) or "    pass"
    doc = (toolset.description or toolset.name).replace('"""', "'''").replace("\\", "\\\\")
    parts.append(f'class {cls}:\n    """{doc}"""\n\n{members}\n')
    parts.append(f'\n__all__ = ["{cls}"]\n')
    return "\n".join(parts)


def _toolset_doc(toolset: Toolset, tools: list[Tool]) -> str:
    cls = class_name(toolset.key)
    lines = [f"# {toolset.name} (`from ptc_tools.{toolset.key} import {cls}`)", ""]
    if toolset.description:
        lines += [toolset.description, ""]
    for tool in tools:
        summary = tool.description.strip().splitlines()[0] if tool.description.strip() else ""
        lines.append(f"- `{cls}.{tool_signature(tool)}`: {summary}")
    return "\n".join(lines) + "\n"


@functools.cache
def _runtime_files() -> dict[str, str]:
    return {
        "ptc_tools/_runtime.py": (_RUNTIME_DIR / "runtime.py").read_text(),
        "ptc_tools/_protocol.py": (_RUNTIME_DIR / "protocol.py").read_text(),
    }


def _ptc_tools(toolsets: list[Toolset]) -> list[tuple[Toolset, list[Tool]]]:
    direct_only = direct_only_tools()
    return [
        (
            toolset,
            sorted(
                (t for t in toolset.tools.all() if t.enabled and tool_is_ptc(tool=t, toolset=toolset, direct_only=direct_only)),
                key=lambda t: t.name,
            ),
        )
        for toolset in sorted(toolsets, key=lambda t: t.key)
    ]


def _hash(per_toolset: list[tuple[Toolset, list[Tool]]]) -> str:
    definitions = [
        [ts.key, ts.name, ts.description, [[t.name, t.description, t.input_schema, t.output_schema] for t in tools]]
        for ts, tools in per_toolset
    ]
    digest = hashlib.sha256(GENERATOR_VERSION.encode())
    digest.update(json.dumps(definitions, sort_keys=True, separators=(",", ":")).encode())
    for name, content in sorted(_runtime_files().items()):
        digest.update(name.encode() + content.encode())
    return digest.hexdigest()


def sdk_hash(*, toolsets: list[Toolset]) -> str:
    """Return the content hash of the SDK for ``toolsets`` without generating it."""
    return _hash(_ptc_tools(toolsets))


def sdk_build(*, toolsets: list[Toolset]) -> Sdk:
    """Return the SDK for ``toolsets`` (with their tools prefetched). Direct tools are left out."""
    per_toolset = _ptc_tools(toolsets)
    files = {"ptc_tools/__init__.py": _INIT, **_runtime_files()}
    docs = {}
    for toolset, tools in per_toolset:
        files[f"ptc_tools/{toolset.key}.py"] = _module_source(toolset, tools)
        docs[toolset.key] = _toolset_doc(toolset, tools)
    return Sdk(hash=_hash(per_toolset), files=files, docs=docs)


def sdk_prepare(*, toolsets: list[Toolset]) -> tuple[str, Path]:
    """Return the hash and on-disk directory of the SDK for ``toolsets``, generating it only if new."""
    digest = sdk_hash(toolsets=toolsets)
    target = sdk_root() / digest
    if target.is_dir():
        return digest, target
    return digest, sdk_materialize(sdk=sdk_build(toolsets=toolsets))


def sdk_root() -> Path:
    """Return the directory SDK builds are staged in, created readable by the sandbox's uid."""
    root = Path(settings.PTC_SANDBOX_DIR) / "sdk"
    root.mkdir(parents=True, exist_ok=True, mode=0o755)
    return root


def sdk_materialize(*, sdk: Sdk) -> Path:
    """Return the directory holding ``sdk``'s files, writing them only if this hash is new."""
    target = sdk_root() / sdk.hash
    if target.is_dir():
        return target
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=sdk_root()))
    try:
        for name, content in sdk.files.items():
            path = staging / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(content)
        for dirpath, _dirnames, filenames in os.walk(staging):
            os.chmod(dirpath, 0o755)
            for filename in filenames:
                os.chmod(os.path.join(dirpath, filename), 0o644)
        try:
            staging.rename(target)  # atomic: a sandbox never sees a half-written SDK
        except OSError:
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
