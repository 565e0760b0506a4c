"""A job's toolsets are built once per content of their rows: given again while no row changed,
read again as soon as any did, however it was changed (a queryset update sends no signal)."""

from django.contrib.auth.models import User

from tests.tools.conftest import unique_key
from tools.models import Tool, Toolset
from tools.selectors import toolsets_resolve


def _resolve(user: User, key: str) -> Toolset:
    [toolset], missing = toolsets_resolve(user=user, keys=[key])
    assert missing == []
    return toolset


def test_toolsets_are_built_again_as_soon_as_a_row_changes() -> None:
    user = User.objects.create(username=unique_key("cache"))
    key = unique_key("cached")
    toolset = Toolset.objects.create(key=key, name="Cached", kind="builtin", owner=user, config={})
    for name in ("a", "b"):
        Tool.objects.create(toolset=toolset, name=name, description=f"{name} v1", input_schema={"type": "object"})

    first = _resolve(user, key)
    assert _resolve(user, key) is first  # nothing changed: the rows as built
    assert [t.description for t in first.tools.all()] == ["a v1", "b v1"]

    Tool.objects.filter(toolset=toolset, name="a").update(description="a v2")
    second = _resolve(user, key)
    assert second is not first
    assert [t.description for t in second.tools.all()] == ["a v2", "b v1"]

    Tool.objects.filter(toolset=toolset, name="b").update(enabled=False)
    assert [t.name for t in _resolve(user, key).tools.all()] == ["a"]

    Tool.objects.create(toolset=toolset, name="c", description="c v1", input_schema={"type": "object"})
    assert [t.name for t in _resolve(user, key).tools.all()] == ["a", "c"]

    Toolset.objects.filter(pk=toolset.pk).update(description="the toolset's own row changed")
    assert _resolve(user, key).description == "the toolset's own row changed"

    Toolset.objects.filter(pk=toolset.pk).update(enabled=False)
    assert toolsets_resolve(user=user, keys=[key]) == ([], [key])


def test_inside_a_transaction_toolsets_are_read_as_they_are() -> None:
    from django.db import transaction

    user = User.objects.create(username=unique_key("cache"))
    key = unique_key("cached")
    toolset = Toolset.objects.create(key=key, name="Cached", kind="builtin", owner=user, config={})
    Tool.objects.create(toolset=toolset, name="a", description="v1", input_schema={"type": "object"})
    with transaction.atomic():
        # Both changes are one transaction's: the row's version (xmin) is the same after each.
        Tool.objects.filter(toolset=toolset).update(description="v2")
        assert [t.description for t in _resolve(user, key).tools.all()] == ["v2"]
        Tool.objects.filter(toolset=toolset).update(description="v3")
        assert [t.description for t in _resolve(user, key).tools.all()] == ["v3"]
    assert [t.description for t in _resolve(user, key).tools.all()] == ["v3"]


def test_a_tools_worker_keeps_tools_only_for_their_moment(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A tools worker kept every tool it ever ran a call with (and its toolset), for its whole
    life: those whose moment has passed are dropped once it keeps TOOL_CACHE_MOST."""
    import uuid

    from tools import selectors

    monkeypatch.setattr(selectors, "_tool_cache", {})
    monkeypatch.setattr(selectors, "TOOL_CACHE_SECONDS", 0.0)  # each one's moment is over at once
    monkeypatch.setattr(selectors, "TOOL_CACHE_MOST", 64, raising=False)
    for _ in range(3 * 64):
        assert selectors.tool_for_call(tool_id=uuid.uuid4()) is None  # no such tool: kept all the same
    assert len(selectors._tool_cache) <= 64
