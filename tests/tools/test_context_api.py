"""POST /api/v1/ptc/context: direct tools in full, one exec_code with the compact reference, the
system-prompt partial, provider formats, the policy's say, and the context economy on a real catalog."""

import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.conftest import Api
from tests.tools.conftest import unique_key
from tests.tools.github import github_tools, github_toolset


@pytest.fixture
def lifecycle(create_toolset: Callable[..., dict[str, Any]]) -> str:
    """An http toolset with two direct tools (a direct-only name, and one not callable from code) and a PTC one."""
    key = unique_key("lifecycle")
    spec = {"method": "POST", "path": "/items", "query": []}
    schema = {"type": "object", "properties": {"summary": {"type": "string"}}, "required": ["summary"]}
    create_toolset(
        {
            "key": key,
            "name": "Lifecycle",
            "kind": "http",
            "config": {"base_url": "http://127.0.0.1:9"},
            "tools": [
                {"name": "complete", "description": "Finish the task.", "input_schema": schema, "http": spec},
                {
                    "name": "notify",
                    "description": "Tell a human.",
                    "input_schema": schema,
                    "allowed_callers": ["direct"],
                    "http": spec,
                },
                {
                    "name": "lookup",
                    "description": "Look a thing up. Fast.",
                    "input_schema": schema,
                    "read_only": True,
                    "http": spec,
                },
            ],
        }
    )
    return key


@pytest.fixture
def policy(staff: Api) -> Iterator[Callable[..., None]]:
    """Change the rollout policy for one test, and put it back after."""
    before = staff.get("/api/v1/policy").json()

    def change(**fields: Any) -> None:
        response = staff.http.patch("/api/v1/policy", json=fields)
        assert response.status_code == 200, response.text

    yield change
    staff.http.patch("/api/v1/policy", json={k: before[k] for k in ("mode", "toolset_blocklist", "sequential")})


def test_anthropic_context(api: Api, lifecycle: str) -> None:
    response = api.post("/api/v1/ptc/context", json={"toolsets": ["demo", lifecycle], "title": "a node", "format": "anthropic"})
    assert response.status_code == 200, response.text
    context = response.json()
    assert context["ptc_enabled"] is True and context["reason"] and context["sequential"] is False
    names = [t["name"] for t in context["tools"]]
    assert names == ["complete", "notify", "exec_code"]
    complete = context["tools"][0]
    assert complete["input_schema"]["required"] == ["summary"] and complete["description"] == "Finish the task."
    reference = context["tools"][-1]["description"]
    assert set(context["tools"][-1]["input_schema"]["properties"]) == {"code"}
    assert "from ptc_tools.demo import Demo" in reference
    assert "add(a: number, b: number) -> number - Add two numbers" in reference
    assert "catalog_search(query: str, category?: str, limit?: int) -> list - Search a fixed product catalog" in reference
    assert "lookup(summary: str) - Look a thing up" in reference
    assert "complete(" not in reference and "notify(" not in reference  # direct tools are never PTC
    prompt = context["system_prompt"]
    assert "from ptc_tools.demo import Demo" in prompt
    assert "may run in parallel" in prompt and "one at a time" in prompt
    assert "Print only what matters" in prompt
    sdk = api.get("/api/v1/sdk", params={"toolset_keys": f"demo,{lifecycle}"}).json()
    assert context["sdk_hash"] == sdk["hash"]
    assert context["stats"]["schema_chars"] > 0 and context["stats"]["compact_chars"] > 0


def test_openai_context(api: Api, lifecycle: str) -> None:
    context = api.post("/api/v1/ptc/context", json={"toolsets": ["demo", lifecycle], "format": "openai"}).json()
    for tool in context["tools"]:
        assert tool["type"] == "function" and "parameters" in tool and "input_schema" not in tool
    assert context["tools"][-1]["name"] == "exec_code"


def test_bad_context_requests(api: Api) -> None:
    unknown = api.post("/api/v1/ptc/context", json={"toolsets": ["nope"]})
    assert unknown.status_code == 400 and unknown.json()["error"]["code"] == "unknown_toolset"
    bad_format = api.post("/api/v1/ptc/context", json={"toolsets": ["demo"], "format": "palm"})
    assert bad_format.status_code == 400 and "format" in bad_format.json()["error"]["details"]


def test_when_the_policy_says_no_every_tool_comes_in_full(api: Api, lifecycle: str, policy: Callable[..., None]) -> None:
    policy(toolset_blocklist=[lifecycle])
    context = api.post("/api/v1/ptc/context", json={"toolsets": ["demo", lifecycle]}).json()
    assert context["ptc_enabled"] is False and lifecycle in context["reason"]
    names = {t["name"] for t in context["tools"]}
    assert "exec_code" not in names
    assert {"add", "catalog_search", "complete", "notify", "lookup"} <= names
    assert context["stats"]["compact_chars"] == context["stats"]["schema_chars"]


def test_sequential_guidance(api: Api, policy: Callable[..., None]) -> None:
    policy(sequential=True)
    context = api.post("/api/v1/ptc/context", json={"toolsets": ["demo"]}).json()
    assert context["sequential"] is True
    assert "one at a time: no thread pools" in context["system_prompt"]
    assert "may run in parallel" not in context["system_prompt"]


def _required(tool: dict[str, Any]) -> list[str]:
    return list(tool["inputSchema"].get("required") or [])


def test_the_context_economy_on_the_github_catalog(api: Api, create_toolset: Callable[..., dict[str, Any]]) -> None:
    catalog = github_tools()
    key = unique_key("github")
    create_toolset(github_toolset(key))
    compact = api.post("/api/v1/ptc/context", json={"toolsets": [key]}).json()
    stats = compact["stats"]
    assert stats["schema_chars"] >= 115_000
    assert stats["compact_chars"] <= 0.10 * stats["schema_chars"], stats
    reference = compact["tools"][-1]["description"]
    for tool in catalog:
        line = next((ln for ln in reference.splitlines() if ln.startswith(tool["name"] + "(")), None)
        assert line is not None, tool["name"]
        params = re.match(r"[^(]*\((.*)\)", line).group(1)  # type: ignore[union-attr]
        for name in _required(tool):
            assert re.search(rf"(^|, ){re.escape(name)}(: |,|$)", params), (tool["name"], name, line)

    discovery = api.post("/api/v1/ptc/context", json={"toolsets": [key], "discovery": True}).json()
    assert discovery["stats"]["compact_chars"] <= 0.03 * discovery["stats"]["schema_chars"], discovery["stats"]
    assert all(t["name"] in discovery["tools"][-1]["description"] for t in catalog)
    assert "ptc_tools.describe(" in discovery["system_prompt"]
