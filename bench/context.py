"""The context-economy figure: the GitHub MCP server's 114 tools as full JSON schemas, against our
PTC context (exec_code with the compact reference, plus the system prompt) and discovery mode.

make bench            (or: python bench/context.py; it needs no server and no database)

The toolset is built from unsaved rows, through the same code as POST /api/v1/ptc/context. The run
fails if a target is missed, or if a tool name or a required parameter is missing from the reference.
"""

import json
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "ptcproject.settings")

import django  # noqa: E402  (after the path is set)

django.setup()

from tools.context import LEVELS, ptc_context_build  # noqa: E402
from tools.models import Tool, Toolset  # noqa: E402
from tools.sdk import ptc_tools_in, sdk_build_of  # noqa: E402

CATALOG = ROOT / "tests" / "tools" / "data" / "github-mcp-tools.json"
TARGETS = {"compact": 0.10, "discovery": 0.03}


def github() -> tuple[Toolset, list[Tool], list[dict]]:
    """Return the GitHub MCP server's tools as an unsaved mcp toolset, and the raw list."""
    raw = json.loads(CATALOG.read_text())["tools"]
    toolset = Toolset(key="github", name="GitHub", description="The GitHub MCP server.", kind=Toolset.Kind.MCP)
    tools = [
        Tool(
            toolset=toolset,
            name=t["name"],
            description=t["description"],
            input_schema=t["inputSchema"],
            read_only=bool(t.get("annotations", {}).get("readOnlyHint")),
        )
        for t in raw
    ]
    # MCP tools are always PTC tools: no policy (and no database) is needed to classify them.
    return toolset, ptc_tools_in(toolset=toolset, tools=tools, direct_only=frozenset()), raw


def missing_from(reference: str, raw: list[dict]) -> list[str]:
    """Return ``tool`` or ``tool.param`` for each tool name or required parameter the reference lacks."""
    lines = {line.split("(", 1)[0]: line for line in reference.splitlines() if "(" in line}
    missing = []
    for tool in raw:
        line = lines.get(tool["name"])
        if line is None:
            missing.append(tool["name"])
            continue
        params = line.split("(", 1)[1].rsplit(")", 1)[0]
        for name in tool["inputSchema"].get("required") or []:
            if not re.search(rf"(^|, ){re.escape(name)}(: |,|$)", params):
                missing.append(f"{tool['name']}.{name}")
    return missing


def table(rows: list[list[str]]) -> None:
    header = ["measure", "characters", "share of the schemas", "target", "met"]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    print("\n### Context economy: the GitHub MCP server's 114 tools\n")
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |")


def main() -> None:
    toolset, tools, raw = github()
    per_toolset = [(toolset, tools)]
    rows, failures = [], []
    for fmt in ("anthropic", "openai"):
        contexts = {
            mode: ptc_context_build(
                fmt=fmt, enabled=True, sequential=False, discovery=mode == "discovery", direct=[], per_toolset=per_toolset
            )
            for mode in ("compact", "discovery")
        }
        schema_chars = contexts["compact"]["stats"]["schema_chars"]
        rows.append([f"{fmt}: all tools as JSON schemas (provider tool list)", f"{schema_chars:,}", "100%", "", ""])
        for mode, label in (("compact", "PTC context: exec_code + system prompt"), ("discovery", "discovery mode: names only")):
            chars = contexts[mode]["stats"]["compact_chars"]
            share = chars / schema_chars
            met = share <= TARGETS[mode]
            rows.append([f"{fmt}: {label}", f"{chars:,}", f"{share:.1%}", f"≤ {TARGETS[mode]:.0%}", "yes" if met else "NO"])
            if not met:
                failures.append(f"{fmt} {mode}: {share:.1%} is over {TARGETS[mode]:.0%}")
            if mode == "compact":
                # The reference is as detailed as the budget allows; this is the floor it starts from.
                terse = ptc_context_build(
                    fmt=fmt,
                    enabled=True,
                    sequential=False,
                    discovery=False,
                    direct=[],
                    per_toolset=per_toolset,
                    levels=LEVELS[-1:],
                )["stats"]["compact_chars"]
                rows.append([f"{fmt}:   the same, tersest (no summaries)", f"{terse:,}", f"{terse / schema_chars:.1%}", "", ""])
        reference = contexts["compact"]["tools"][-1]["description"]
        failures += [f"{fmt}: not visible in the compact reference: {m}" for m in missing_from(reference, raw)]
        failures += [
            f"{fmt}: not in discovery mode: {t['name']}"
            for t in raw
            if t["name"] not in contexts["discovery"]["tools"][-1]["description"]
        ]
    catalog = len(sdk_build_of(per_toolset).files["ptc_tools/_catalog.json"])
    rows.append(["in the sandbox, not the prompt: ptc_tools/_catalog.json", f"{catalog:,}", "", "", ""])
    table(rows)
    required = sum(len(t["inputSchema"].get("required") or []) for t in raw)
    print(f"\nEvery one of the {len(raw)} tool names and {required} required parameters is in the compact reference.")
    print("\nA sample of the reference:\n")
    reference = ptc_context_build(
        fmt="anthropic", enabled=True, sequential=False, discovery=False, direct=[], per_toolset=per_toolset
    )
    print("\n".join("    " + line for line in reference["tools"][-1]["description"].splitlines()[:8]))
    if failures:
        print("\nFAILED:\n" + "\n".join(failures), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
