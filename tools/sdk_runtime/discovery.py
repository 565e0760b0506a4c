"""Tool discovery inside the sandbox, shipped as ``ptc_tools/_discovery.py``. Standard library only.

``describe("github.list_issues")`` returns one tool's full schema and docs; ``search("issue
comment")`` returns the signatures of the tools that match best. Both read ``_catalog.json``, which
the SDK generator writes beside the toolsets' modules: the definitions of the job's PTC tools, and nothing
else (no config, no secrets). No network is needed, and the catalog is read on first use only.
"""

import os
import re
from typing import Any

_catalog: list[dict[str, Any]] | None = None
_WORD = re.compile(r"[a-z0-9]+")


def forget() -> None:
    """A session's job whose SDK changed: the catalog is read again, the new one."""
    global _catalog
    _catalog = None


def _tools() -> list[dict[str, Any]]:
    global _catalog
    if _catalog is None:
        import ptc_tools
        from ptc_tools import _protocol, _runtime

        _runtime.sdk_need("ptc_tools/_catalog.json")
        # Beside the toolsets' modules, which may sit apart from this file (a warm sandbox imports
        # the package before its job brings them): the package's path has both.
        for folder in reversed(ptc_tools.__path__):
            path = os.path.join(folder, "_catalog.json")
            if os.path.exists(path):
                with open(path, encoding="utf-8") as f:
                    _catalog = _protocol.json_loads(f.read())["tools"]  # json's as it was: the code may replace it
                break
        else:
            _catalog = []
    return _catalog


class ToolDoc(dict):
    """One tool's definition: a dict (``doc["input_schema"]``) that prints as readable docs."""

    def __str__(self) -> str:
        lines = [f"{self['toolset']}.{self['signature']}", f"    from ptc_tools.{self['toolset']} import {self['class']}"]
        lines.append(f"    {self['class']}.{self['name']}(...)  # {'read-only' if self['read_only'] else 'has side effects'}")
        if self["description"]:
            lines += ["", self["description"].strip()]
        if self["parameters"]:
            lines += ["", "Parameters:"]
            lines += [f"    {p}" for p in self["parameters"]]
        lines += ["", f"Returns: {self['returns']}", "", "input_schema: " + _json_dumps(self["input_schema"], sort_keys=True)]
        if self["output_schema"] is not None:
            lines.append("output_schema: " + _json_dumps(self["output_schema"], sort_keys=True))
        return "\n".join(lines)

    __repr__ = __str__


def describe(name: str) -> ToolDoc:
    """Return the full definition and docs of one tool: ``describe("demo.add")``.

    ``name`` is ``toolset.tool``, ``Class.tool``, or a bare tool name that only one toolset has.
    Raise LookupError, naming close matches, if there is no such tool.
    """
    wanted = name.strip()
    tools = _tools()
    if "." in wanted:
        prefix, _, tool = wanted.rpartition(".")
        found = [t for t in tools if t["name"] == tool and prefix in (t["toolset"], t["class"])]
    else:
        found = [t for t in tools if t["name"] == wanted]
    if len(found) == 1:
        return ToolDoc(found[0])
    if len(found) > 1:
        raise LookupError(f"{wanted!r} is in several toolsets: " + ", ".join(f"{t['toolset']}.{t['name']}" for t in found))
    close = search(wanted.replace(".", " ").replace("_", " "), limit=5)
    hint = ("; close matches: " + "; ".join(close)) if close else ""
    raise LookupError(f"no tool {wanted!r}{hint}")


def _stem(word: str) -> str:
    return word[:-1] if len(word) > 3 and word.endswith("s") else word


def search(query: str, limit: int = 10) -> list[str]:
    """Return up to ``limit`` signatures of the tools that best match the words of ``query``.

    A word found in a tool's name counts three times one found only in its description.
    Each result reads ``toolset.tool(params) -> returns  # summary``.
    """
    words = [_stem(w) for w in _WORD.findall(query.lower())]
    if not words:
        return []
    scored = []
    for position, tool in enumerate(_tools()):
        name_words = [_stem(w) for w in _WORD.findall(f"{tool['toolset']} {tool['name']}".lower())]
        text = f"{tool['name']} {tool['description']}".lower()
        score = sum(3 if any(n.startswith(w) for n in name_words) else 1 if w in text else 0 for w in words)
        if score:
            matched_all = all(any(n.startswith(w) for n in name_words) or w in text for w in words)
            scored.append((-(score + (2 if matched_all else 0)), position, tool))
    scored.sort(key=lambda s: (s[0], s[1]))
    out = []
    for _, _, tool in scored[: max(0, limit)]:
        summary = f"  # {tool['summary']}" if tool["summary"] else ""
        out.append(f"{tool['toolset']}.{tool['signature']}{summary}")
    return out


def _json_dumps(value: Any, **options: Any) -> str:
    from ptc_tools import _protocol  # json's as it was when the runner started: the code may replace it

    return _protocol.json_dumps(value, **options)
