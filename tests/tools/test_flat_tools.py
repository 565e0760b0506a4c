"""The seed's flat style in the sandbox: ``tools.<name>(...)`` calls the one granted tool of that name,
and a name two granted toolsets share is a ToolError ``ambiguous_tool`` naming both."""

from collections.abc import Callable
from typing import Any

from tests.conftest import Api
from tests.tools.conftest import private_http_toolset, unique_key
from tools.models import Toolset
from tools.sdk import sdk_build


def test_tools_routes_a_bare_name_to_its_toolset(api: Api) -> None:
    code = """
import asyncio
from ptc_tools import tools as imported
slept = await tools.sleep.aio(ms=10)
print(imported is tools, "add" in dir(tools), repr(tools.add))
try:
    tools.no_such_tool
except AttributeError as e:
    print("missing:", e)
tools.add(a=1, b=2) + slept["slept_ms"]
"""
    job = api.run(code, toolsets=["demo"])
    assert job["status"] == "completed", job["error"]
    assert job["return_value"] == 13
    lines = job["stdout"].splitlines()
    assert lines[0] == "True True <tool demo.add>"
    assert lines[1].startswith("missing: no granted tool is named 'no_such_tool'")
    # Calls made the flat way are the same records as any other.
    assert [(c["toolset"], c["tool"], c["status"]) for c in job["tool_calls"]] == [
        ("demo", "sleep", "completed"),
        ("demo", "add", "completed"),
    ]


def test_a_name_in_two_granted_toolsets_is_a_clear_error(staff: Api, create_toolset: Callable[..., dict[str, Any]]) -> None:
    key = unique_key("calc")
    schema = {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}
    create_toolset(
        private_http_toolset(key, "Calc", [{"name": "add", "input_schema": schema, "http": {"method": "POST", "path": "/add"}}])
    )
    code = """
from ptc_tools import ToolError
try:
    tools.add(a=1, b=2)
except ToolError as e:
    print(e.code)
    print(e.message)
tools.echo(value="unique names still route")
"""
    job = staff.run(code, toolsets=["demo", key])
    assert job["status"] == "completed", job["error"]
    code_line, message = job["stdout"].splitlines()
    assert code_line == "ambiguous_tool"
    assert "'add' is in several granted toolsets" in message and "demo (Demo.add)" in message and f"{key} (" in message
    assert job["return_value"] == "unique names still route"
    assert [c["tool"] for c in job["tool_calls"]] == ["echo"]  # the ambiguous call was never made


def test_the_sdk_with_the_flat_module_keeps_a_deterministic_hash() -> None:
    demo = Toolset.objects.prefetch_related("tools").get(key="demo", owner=None)
    first, second = sdk_build(toolsets=[demo]), sdk_build(toolsets=[demo])
    assert first.hash == second.hash and first.files == second.files
    assert "ptc_tools/_flat.py" in first.files and "from ptc_tools._flat import tools" in first.files["ptc_tools/__init__.py"]
