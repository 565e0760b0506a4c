"""The demo toolset, the generated SDK, and how a job's SDK reaches its sandbox."""

from collections.abc import Callable
from typing import Any

import pytest

from tests.conftest import Api
from tests.tools.conftest import unique_key
from tools.models import Tool, Toolset
from tools.sdk import class_name, sdk_build


def test_migrate_creates_the_demo_toolset() -> None:
    demo = Toolset.objects.get(key="demo", owner=None)
    assert demo.kind == "builtin" and demo.is_global and demo.price == 1
    tools = {t.name: t for t in demo.tools.all()}
    assert set(tools) == {"echo", "add", "sleep", "fail", "catalog_search"}
    assert tools["echo"].billing_free


def test_class_names() -> None:
    assert class_name("demo") == "Demo"
    assert class_name("web_search") == "WebSearch"


def test_sdk_is_deterministic_and_documents_each_tool() -> None:
    demo = Toolset.objects.prefetch_related("tools").get(key="demo", owner=None)
    first, second = sdk_build(toolsets=[demo]), sdk_build(toolsets=[demo])
    assert first.hash == second.hash
    source = first.files["ptc_tools/demo.py"]
    assert "class Demo:" in source
    assert "catalog_search(query: str, category?: str, limit?: int) -> list" in source
    assert "def _add(*, a: float, b: float) -> float:" in source
    assert "demo" in first.docs


def test_a_direct_tool_never_enters_the_sdk() -> None:
    toolset = Toolset.objects.create(key="lifecycle_sdk_test", name="Lifecycle", kind="http", owner=None)
    Tool.objects.create(toolset=toolset, name="complete", input_schema={"type": "object"})
    Tool.objects.create(toolset=toolset, name="notify", input_schema={"type": "object"}, allowed_callers=["direct"])
    Tool.objects.create(toolset=toolset, name="lookup", input_schema={"type": "object"})
    toolset = Toolset.objects.prefetch_related("tools").get(pk=toolset.pk)
    source = sdk_build(toolsets=[toolset]).files["ptc_tools/lifecycle_sdk_test.py"]
    assert "def _lookup(" in source
    assert "_complete" not in source and "_notify" not in source
    toolset.delete()


LAZY_SDK = """
import os
import ptc_tools
folder = "/opt/ptc/sdk/ptc_tools"
listed = lambda: sorted(os.listdir(folder)) if os.path.isdir(folder) else []
seen = [listed()]
from ptc_tools.demo import Demo
seen.append(listed())
doc = ptc_tools.describe("demo.echo")
seen.append(listed())
import inspect, sys
loaded = [type(sys.modules["ptc_tools.demo"].__loader__).__name__, inspect.getsource(Demo.echo).split("(")[0]]
[seen, doc["name"], Demo.echo(value="called"), loaded]
"""


def test_a_jobs_sdk_files_reach_the_sandbox_as_its_code_first_uses_them(
    staff: Api, create_toolset: Callable[..., dict[str, Any]]
) -> None:
    # A toolset the code never imports costs the job nothing: its module and the catalog are asked
    # of the worker only when the code imports the one or reads the other.
    key = _http_toolset(create_toolset, ["lookup"])
    job = staff.run(LAZY_SDK, toolsets=["demo", key])
    assert job["status"] == "completed", job["error"]
    seen, name, echoed, loaded = job["return_value"]
    assert seen == [[], ["demo.py"], ["_catalog.json", "demo.py"]]
    assert (name, echoed) == ("echo", "called")
    # The module came compiled by the worker (the sandbox's interpreter reads its bytecode); its
    # source is there beside it, for tracebacks and inspect.
    assert loaded == ["_CodeLoader", "def _echo"]


def test_a_sessions_job_gets_its_changed_sdk_not_the_last_ones_files(
    staff: Api, create_toolset: Callable[..., dict[str, Any]]
) -> None:
    key = _http_toolset(create_toolset, ["lookup"])
    session = staff.post("/api/v1/sessions", json={"toolsets": [key]}).json()
    # A plain import (no reload), the package's attribute, and the flat names: each the new SDK's.
    cls = class_name(key)
    tools = (
        f"import ptc_tools\nfrom ptc_tools.{key} import {cls}\n"
        f"[sorted(n for n in vars({cls}) if not n.startswith('_')), ptc_tools.{key}.{cls} is {cls}, repr(getattr(tools, 'search', None))]"
    )
    try:
        first = staff.run(tools, session=session["id"])
        assert (first["status"], first["return_value"]) == ("completed", [["lookup"], True, "None"]), first["error"]
        schema = {"type": "object", "properties": {}}
        edit = staff.http.patch(
            f"/api/v1/toolsets/{key}",
            json={
                "tools": [
                    {"name": name, "input_schema": schema, "http": {"method": "GET", "path": f"/{name}"}}
                    for name in ("lookup", "search")
                ]
            },
        )
        assert edit.status_code == 200, edit.text
        second = staff.run(tools, session=session["id"])
        assert second["status"] == "completed", second["error"]
        assert second["return_value"] == [["lookup", "search"], True, f"<tool {key}.search>"]
    finally:
        staff.http.delete(f"/api/v1/sessions/{session['id']}")


@pytest.mark.parametrize("asks", [["ptc_tools/other.py"], ["../../etc/passwd"], [["a list"]], ["ptc_tools/demo.py"] * 2])
def test_a_sandbox_that_asks_for_what_is_no_file_of_its_sdk_or_a_file_again_ends_its_job(staff: Api, asks: list[Any]) -> None:
    # Its runtime asks for each file once, when first used: a sandbox that asks for anything else
    # is not the runtime, and the worker sends it nothing more (no SDK twice a job, either).
    code = f"from ptc_tools import _runtime\nfor name in {asks!r}:\n    _runtime.sdk_file(name)"
    job = staff.run(code, toolsets=["demo"])
    assert (job["status"], job["error"]["type"]) == ("failed", "BridgeError")
    assert "no file of its SDK, or one sent already" in job["error"]["message"]


def _http_toolset(create_toolset: Callable[..., dict[str, Any]], names: list[str]) -> str:
    key = unique_key("lazy")
    create_toolset(
        {
            "key": key,
            "name": "Lazy",
            "kind": "http",
            "is_global": False,  # the staff member's own: no other test sees it
            "config": {"base_url": "http://127.0.0.1:9", "timeout": 1},
            "tools": [
                {
                    "name": name,
                    "input_schema": {"type": "object", "properties": {}},
                    "http": {"method": "GET", "path": f"/{name}"},
                }
                for name in names
            ],
        }
    )
    return key
