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
