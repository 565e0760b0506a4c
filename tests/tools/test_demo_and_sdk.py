"""The demo toolset, the generated SDK, and how a job's SDK reaches its sandbox."""

import importlib.util
import subprocess
from collections.abc import Callable
from typing import Any

from django.conf import settings

from tests.conftest import Api
from tests.tools.conftest import private_http_toolset, unique_key
from tools.models import Tool, Toolset
from tools.sdk import class_name, sdk_build


def test_migrate_creates_the_demo_toolset() -> None:
    demo = Toolset.objects.get(key="demo", owner=None)
    assert demo.kind == "builtin" and demo.is_global and demo.price == 1
    tools = {t.name: t for t in demo.tools.all()}
    assert set(tools) == {"echo", "add", "sleep", "fail", "catalog_search"}
    assert tools["echo"].billing_free


def test_migrate_leaves_a_builtin_tool_an_admin_disabled_disabled() -> None:
    """Which builtin tools run is the admin's call, as which builtin toolsets do: every migrate (a
    deploy's, each web pod's init container) enabled a tool the admin had disabled (say a tool that
    was being abused) again, and the next jobs called it."""
    from django.core.management import call_command

    sleep = Tool.objects.filter(toolset__key="demo", toolset__owner=None, name="sleep")
    sleep.update(enabled=False)  # the tool's admin page, "enabled" unticked
    try:
        call_command("migrate", verbosity=0)
        assert sleep.get().enabled is False
        assert Tool.objects.get(toolset__key="demo", toolset__owner=None, name="add").enabled
    finally:
        sleep.update(enabled=True)


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
listed = lambda: {name: os.path.getsize(os.path.join(folder, name)) > 0 for name in os.listdir(folder)}
import pkgutil
modules = sorted(m.name for m in pkgutil.iter_modules(ptc_tools.__path__) if not m.name.startswith("_"))
seen = [listed()]
from ptc_tools.demo import Demo
seen.append(listed())
doc = ptc_tools.describe("demo.echo")
seen.append(listed())
import inspect, sys
loaded = [type(sys.modules["ptc_tools.demo"].__loader__).__name__, inspect.getsource(Demo.echo).split("(")[0]]
import contextlib, io
shown = io.StringIO()
with contextlib.redirect_stdout(shown):
    help(ptc_tools)
[seen, doc["name"], Demo.echo(value="called"), loaded, modules, "demo" in shown.getvalue(), callable(exit) and callable(quit)]
"""


def test_a_jobs_sdk_files_reach_the_sandbox_as_its_code_first_uses_them(
    staff: Api, create_toolset: Callable[..., dict[str, Any]]
) -> None:
    # A toolset the code never imports costs the job nothing: its module and the catalog are asked
    # of the worker only when the code imports the one or reads the other.
    # Until then each module is an empty file, so that pkgutil and help(ptc_tools) list it.
    key = _http_toolset(create_toolset, ["lookup"])
    job = staff.run(LAZY_SDK, toolsets=["demo", key])
    assert job["status"] == "completed", job["error"]
    seen, name, echoed, loaded, modules, helped, quits = job["return_value"]
    assert helped and quits  # the builtins of a plain Python (site's), though the sandbox runs with -S
    module = f"{key}.py"
    assert seen == [
        {"demo.py": False, module: False},
        {"demo.py": True, module: False},
        {"demo.py": True, module: False, "_catalog.json": True},
    ]
    assert modules == ["demo", key]
    assert (name, echoed) == ("echo", "called")
    # The module came compiled by the worker when the sandbox's interpreter reads the worker's
    # bytecode (else it compiles the source); the source is there beside it, for inspect.
    same = (
        subprocess.run(
            [settings.PTC_SANDBOX_PYTHON, "-c", "import importlib.util; print(importlib.util.MAGIC_NUMBER.hex())"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        == importlib.util.MAGIC_NUMBER.hex()
    )
    assert loaded == ["_CodeLoader" if same else "SourceFileLoader", "def _echo"]


def test_threads_that_first_read_the_catalog_at_once_ask_for_it_once(staff: Api) -> None:
    # The flat names read the catalog: eight threads do it at once, and each gets its tool.
    code = "from concurrent.futures import ThreadPoolExecutor\nlist(ThreadPoolExecutor(8).map(lambda i: tools.echo(value=i), range(8)))"
    job = staff.run(code, toolsets=["demo"])
    assert (job["status"], job["return_value"]) == ("completed", list(range(8))), job["error"]


def test_a_sessions_job_gets_its_changed_sdk_not_the_last_ones_files(
    staff: Api, create_toolset: Callable[..., dict[str, Any]]
) -> None:
    key = _http_toolset(create_toolset, ["lookup"])
    session = staff.post("/api/v1/sessions", json={"toolsets": [key]}).json()
    # A plain import (no reload), the package's attribute, and the flat names: each the new SDK's.
    cls = class_name(key)
    imports = f"import ptc_tools\nfrom ptc_tools.{key} import {cls}\n"
    found = f"[sorted(n for n in vars({cls}) if not n.startswith('_')), ptc_tools.{key}.{cls} is {cls}, repr(getattr(tools, 'search', None))]"
    try:
        # The first job also leaves the SDK's folder gone: the next job's SDK goes in all the same.
        first = staff.run(
            f"{imports}found = {found}\nimport shutil\nshutil.rmtree('/opt/ptc/sdk/ptc_tools')\nfound", session=session["id"]
        )
        assert (first["status"], first["return_value"]) == ("completed", [["lookup"], True, "None"]), first["error"]
        edit = staff.http.patch(f"/api/v1/toolsets/{key}", json={"tools": _get_tools(["lookup", "search"])})
        assert edit.status_code == 200, edit.text
        second = staff.run(imports + found, session=session["id"])
        assert second["status"] == "completed", second["error"]
        assert second["return_value"] == [["lookup", "search"], True, f"<tool {key}.search>"]
    finally:
        staff.http.delete(f"/api/v1/sessions/{session['id']}")


def test_a_sandbox_gets_only_its_jobs_sdk_files_each_once_and_asks_a_bounded_number_of_times(staff: Api) -> None:
    # Its runtime asks for each file once, when first used. Any other ask gets not_found (a thread
    # an earlier job of a session left may ask for that job's files); nothing is sent twice; and a
    # sandbox that keeps asking is not the runtime: its job ends.
    code = """
from ptc_tools import _runtime, ToolError
def ask(name):
    try:
        _runtime.sdk_file(name)
        return "sent"
    except ToolError as e:
        return e.code
print([ask(name) for name in ("../../etc/passwd", ["a list"], "ptc_tools/other.py", "ptc_tools/demo.py", "ptc_tools/demo.py")])
while True:
    ask("ptc_tools/demo.py")
"""
    job = staff.run(code, toolsets=["demo"])
    assert job["stdout"] == str(["not_found"] * 3 + ["sent", "not_found"]) + "\n"
    assert (job["status"], job["error"]["type"]) == ("failed", "BridgeError")
    assert "asked for its SDK's files over" in job["error"]["message"]


def _http_toolset(create_toolset: Callable[..., dict[str, Any]], names: list[str]) -> str:
    key = unique_key("lazy")
    create_toolset(private_http_toolset(key, "Lazy", _get_tools(names)))
    return key


def _get_tools(names: list[str]) -> list[dict[str, Any]]:
    """http tools ``GET /<name>``, taking no arguments."""
    return [
        {"name": n, "input_schema": {"type": "object", "properties": {}}, "http": {"method": "GET", "path": f"/{n}"}}
        for n in names
    ]
