"""The toolset admin: the same checks as the API, write-only secrets, pretty schemas, and the sync action."""

import json
import uuid
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from tests.tools.conftest import mcp_stdio_config, unique_key
from tools.kinds import mcp
from tools.models import Toolset


@pytest.fixture
def admin_client() -> Client:
    staff = get_user_model().objects.create_user(username=f"admin-{uuid.uuid4().hex[:6]}", is_staff=True, is_superuser=True)
    client = Client()
    client.force_login(staff)
    return client


def _form(key: str, tool_name: str, secrets: str) -> dict[str, Any]:
    return {
        "key": key,
        "name": "Weather",
        "description": "",
        "kind": "http",
        "is_global": "on",
        "enabled": "on",
        "price": "0",
        "config": json.dumps({"base_url": "http://127.0.0.1:9", "headers": {"X-Key": "{{secrets.KEY}}"}}),
        "set_secrets": secrets,
        "tools-TOTAL_FORMS": "1",
        "tools-INITIAL_FORMS": "0",
        "tools-MIN_NUM_FORMS": "0",
        "tools-MAX_NUM_FORMS": "1000",
        "tools-0-name": tool_name,
        "tools-0-remote_name": "",
        "tools-0-description": "",
        "tools-0-input_schema": json.dumps({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}),
        "tools-0-output_schema": "",
        "tools-0-allowed_callers": "[]",
        "tools-0-timeout": "",
        "tools-0-price": "",
        "tools-0-enabled": "on",
        "tools-0-http": json.dumps({"method": "GET", "path": "/forecast/{city}", "query": []}),
    }


def test_admin_checks_a_toolset_like_the_api(admin_client: Client) -> None:
    key = unique_key("adminbad")
    page = admin_client.post("/admin/tools/toolset/add/", _form(key, "not-a-name", '{"KEY": "v4lue-1"}'))
    assert page.status_code == 200  # the form again, with the problem named
    assert "invalid_tool_name" in page.content.decode()
    assert not Toolset.objects.filter(key=key).exists()
    page = admin_client.post("/admin/tools/toolset/add/", _form(key, "forecast", ""))
    assert "unknown_secret" in page.content.decode()
    assert not Toolset.objects.filter(key=key).exists()
    page = admin_client.post("/admin/tools/toolset/add/", _form(key, "forecast", '{"KEY": "v4lue-1", "bad key!": "x"}'))
    assert "is not a secret&#x27;s name" in page.content.decode()
    assert not Toolset.objects.filter(key=key).exists()


def test_admin_secrets_are_write_only(admin_client: Client) -> None:
    key = unique_key("adminok")
    secret = f"v-{uuid.uuid4().hex}"
    response = admin_client.post("/admin/tools/toolset/add/", _form(key, "forecast", json.dumps({"KEY": secret})))
    assert response.status_code == 302, response.content.decode()[:2000]
    toolset = Toolset.objects.get(key=key)
    assert toolset.secrets == {"KEY": secret}
    page = admin_client.get(f"/admin/tools/toolset/{toolset.pk}/change/").content.decode()
    assert secret not in page and "Set now: KEY." in page
    assert "&quot;type&quot;: &quot;object&quot;" in page and "\n  &quot;properties&quot;" in page  # pretty-printed
    # Saving the form again with the secrets field left empty keeps them.
    form = _form(key, "forecast", "")
    form.update({"tools-INITIAL_FORMS": "1", "tools-0-id": str(toolset.tools.get().pk), "tools-0-toolset": str(toolset.pk)})
    assert admin_client.post(f"/admin/tools/toolset/{toolset.pk}/change/", form).status_code == 302
    toolset.refresh_from_db()
    assert toolset.secrets == {"KEY": secret}
    toolset.delete()


def test_a_toolset_form_drawn_again_after_an_error_shows_no_secret_typed_in_it(admin_client: Client) -> None:
    """Drawn again for a field's error, the form showed the secrets just typed in the clear (its
    textarea holding them), as it did when the error was a secret's own (not ASCII in a header)."""
    secret = f"v-{uuid.uuid4().hex}"
    for tool_name, value in (("not-a-name", secret), ("forecast", f"é{secret}")):
        key = unique_key("adminagain")
        page = admin_client.post("/admin/tools/toolset/add/", _form(key, tool_name, json.dumps({"KEY": value})))
        assert page.status_code == 200 and "errorlist" in page.content.decode()  # the form again, with its error
        assert secret not in page.content.decode()
        assert "The secrets you typed are not shown again: type them again." in page.content.decode()
        assert not Toolset.objects.filter(key=key).exists()


UNSTORABLE_JSON = {
    "a NUL in a header": (
        "config",
        {"base_url": "http://127.0.0.1:9", "headers": {"X-Key": "{{secrets.KEY}}", "X-A": "a\u0000"}},
    ),
    "a NUL in a key": ("config", {"base_url": "http://127.0.0.1:9", "headers": {"X-Key": "{{secrets.KEY}}"}, "k\u0000": 1}),
    "a NUL in an output schema": ("tools-0-output_schema", {"type": "object", "description": "a\u0000b"}),
    "a NUL in a path": ("tools-0-http", {"method": "GET", "path": "/forecast/{city}\u0000", "query": []}),
    "lists 100,000 deep": ("tools-0-output_schema", "[" * 100_000 + "]" * 100_000),
}


@pytest.mark.parametrize("case", list(UNSTORABLE_JSON))
def test_json_the_database_cant_hold_is_a_field_error_in_the_admin(admin_client: Client, case: str) -> None:
    """Each was a 500: PostgreSQL's jsonb refused the row (a NUL, NaN), or json.loads ran out of stack."""
    field, value = UNSTORABLE_JSON[case]
    key = unique_key("adminjson")
    form = {**_form(key, "forecast", '{"KEY": "v"}'), field: value if isinstance(value, str) else json.dumps(value)}
    page = Client(raise_request_exception=False)
    page.cookies = admin_client.cookies
    response = page.post("/admin/tools/toolset/add/", form)
    assert response.status_code == 200 and "errorlist" in response.content.decode()
    assert not Toolset.objects.filter(key=key).exists()


def test_a_toolset_moved_onto_a_key_taken_is_a_field_error_in_the_admin(admin_client: Client) -> None:
    """The key is read-only once made, so the form's own check of the (key, owner) constraints
    skipped them: a toolset given to a user who has one of its key, or made global where a global
    one has it, was an IntegrityError, a 500, as the API answers 409 toolset_exists."""
    users = get_user_model().objects
    alice, bob = (users.create_user(username=f"{name}-{uuid.uuid4().hex[:6]}") for name in ("alice", "bob"))
    key = unique_key("clash")
    config = {"base_url": "http://127.0.0.1:9"}
    Toolset.objects.create(key=key, name="G", kind="http", config=config, is_global=True)
    Toolset.objects.create(key=key, name="B", kind="http", config=config, is_global=False, owner=bob)
    mine = Toolset.objects.create(key=key, name="A", kind="http", config=config, is_global=False, owner=alice)
    form = {
        **{name: value for name, value in _form(key, "forecast", "").items() if not name.startswith("tools-0-")},
        **{"tools-TOTAL_FORMS": "0", "config": json.dumps(config), "queue": "tools"},
    }
    client = Client(raise_request_exception=False)
    client.cookies = admin_client.cookies
    for moved, said in (
        ({"owner": str(bob.pk), "is_global": ""}, f"{bob} has a toolset with key &#x27;{key}&#x27; already"),
        ({"owner": "", "is_global": "on"}, f"A global toolset with key &#x27;{key}&#x27; already"),
    ):
        page = client.post(f"/admin/tools/toolset/{mine.pk}/change/", {**form, **moved})
        assert page.status_code == 200 and said in page.content.decode()
        mine.refresh_from_db()
        assert (mine.owner, mine.is_global) == (alice, False)


def test_admin_sync_action(admin_client: Client) -> None:
    marker = uuid.uuid4().hex
    toolset = Toolset.objects.create(key=unique_key("adminsync"), name="MCP", kind="mcp", config=mcp_stdio_config(marker))
    response = admin_client.post(
        "/admin/tools/toolset/", {"action": "sync_mcp_tools", "_selected_action": [str(toolset.pk)]}, follow=True
    )
    assert response.status_code == 200
    assert f"Synced &#x27;{toolset.key}&#x27;: added 8, updated 0, disabled 0." in response.content.decode()
    assert toolset.tools.filter(name="get_thing", remote_name="get-thing").exists()
    mcp.sessions_close()
    toolset.delete()


def test_a_toolsets_key_is_fixed_once_made_in_the_admin_too(admin_client: Client) -> None:
    """The API refuses a new key (key_mismatch); the admin renamed one, which took a blocklisted
    toolset off the policy's blocklist, and left its jobs and calls naming a key no longer there."""
    key = unique_key("fixedkey")
    assert admin_client.post("/admin/tools/toolset/add/", _form(key, "forecast", '{"KEY": "v4lue-1"}')).status_code == 302
    toolset = Toolset.objects.get(key=key)
    form = {**_form(f"{key}_renamed", "forecast", ""), "name": "Renamed"}
    form.update({"tools-INITIAL_FORMS": "1", "tools-0-id": str(toolset.tools.get().pk), "tools-0-toolset": str(toolset.pk)})
    saved = admin_client.post(f"/admin/tools/toolset/{toolset.pk}/change/", form)
    assert saved.status_code == 302, saved.content.decode()[:2000]
    toolset.refresh_from_db()
    assert (toolset.key, toolset.name) == (key, "Renamed")


def test_the_admin_deletes_no_builtin_toolset_or_tool_and_says_why(admin_client: Client) -> None:
    """The API refuses (builtin_toolset: disable it instead). The admin deleted demo: every job's
    calls of it failed unknown_tool, new jobs unknown_toolset, until the next migrate, and its
    discounts (which migrate does not bring back) went with it."""
    from billing.models import Discount
    from tools.services import builtin_toolsets_sync

    demo = Toolset.objects.get(key="demo", owner=None)
    tools = sorted(demo.tools.values_list("pk", flat=True))
    discount = Discount.objects.create(toolset=demo, percent=10)
    add = demo.tools.get(name="add")
    try:
        page = admin_client.post(f"/admin/tools/toolset/{demo.pk}/delete/", {"post": "yes"})
        assert "builtin toolset" in page.content.decode()
        action = {"action": "delete_selected", "_selected_action": [str(demo.pk)], "post": "yes"}
        assert "builtin toolset" in admin_client.post("/admin/tools/toolset/", action).content.decode()
        page = admin_client.post(f"/admin/tools/tool/{add.pk}/delete/", {"post": "yes"})
        assert "builtin toolset" in page.content.decode()
        page = admin_client.get(f"/admin/tools/toolset/{demo.pk}/change/")  # nor from the toolset's page
        assert page.status_code == 200 and 'name="tools-0-DELETE"' not in page.content.decode()
        assert sorted(Toolset.objects.get(pk=demo.pk).tools.values_list("pk", flat=True)) == tools
        assert Discount.objects.filter(pk=discount.pk).exists()
    finally:
        Discount.objects.filter(pk=discount.pk).delete()
        builtin_toolsets_sync()  # whatever a failing run deleted, for the tests after it


@pytest.mark.parametrize("timeout", ["-1", "0.01", "1e12"])
def test_the_admin_takes_a_tools_timeout_the_api_takes_and_no_other(admin_client: Client, timeout: str) -> None:
    """The API holds a tool's timeout to 0.1 s .. PTC_TIMEOUT_CEILING. The admin saved any: -1 ended
    every call tool_timeout at once, and 1e12 put its calls' deadline past the calendar's end, so the
    end of a job that one of them outlived (its close waits for them) raised OverflowError, never announced."""
    key = unique_key("timeout")
    assert admin_client.post("/admin/tools/toolset/add/", _form(key, "forecast", '{"KEY": "v4lue-1"}')).status_code == 302
    toolset = Toolset.objects.get(key=key)
    form = {**_form(key, "forecast", ""), "tools-0-timeout": timeout}
    form.update({"tools-INITIAL_FORMS": "1", "tools-0-id": str(toolset.tools.get().pk), "tools-0-toolset": str(toolset.pk)})
    page = admin_client.post(f"/admin/tools/toolset/{toolset.pk}/change/", form)
    assert page.status_code == 200  # the form again, with the problem named
    assert "Ensure this value is" in page.content.decode()
    assert toolset.tools.get().timeout is None
    form["tools-0-timeout"] = "30"
    assert admin_client.post(f"/admin/tools/toolset/{toolset.pk}/change/", form).status_code == 302
    assert toolset.tools.get().timeout == 30


def _change_form(toolset: Toolset) -> dict[str, Any]:
    """The toolset's change form as its page posts it, every field as stored."""
    form: dict[str, Any] = {
        **{name: getattr(toolset, name) for name in ("key", "name", "description", "kind", "price", "queue")},
        "config": json.dumps(toolset.config),
        "set_secrets": "",
        **{name: "on" for name in ("is_global", "enabled", "billing_free", "requires_approval") if getattr(toolset, name)},
    }
    tools = list(toolset.tools.order_by("name"))
    form.update({"tools-TOTAL_FORMS": str(len(tools)), "tools-INITIAL_FORMS": str(len(tools))})
    form.update({"tools-MIN_NUM_FORMS": "0", "tools-MAX_NUM_FORMS": "1000"})
    for i, tool in enumerate(tools):
        prefix = f"tools-{i}-"
        form.update({f"{prefix}id": str(tool.pk), f"{prefix}toolset": str(toolset.pk), f"{prefix}name": tool.name})
        form.update({f"{prefix}{name}": getattr(tool, name) or "" for name in ("remote_name", "description", "timeout", "price")})
        for name in ("input_schema", "output_schema", "allowed_callers", "http"):
            form[f"{prefix}{name}"] = "" if getattr(tool, name) is None else json.dumps(getattr(tool, name))
        form.update(
            {
                f"{prefix}{name}": "on"
                for name in ("read_only", "billing_free", "requires_approval", "enabled")
                if getattr(tool, name)
            }
        )
    return form


def test_the_admin_changes_of_a_builtin_only_what_migrate_keeps(admin_client: Client) -> None:
    """What `migrate` rewrites from the code (a builtin's price, kind, its tools' names, schemas and
    prices) is read-only, as the API refuses it (builtin_toolset): a price the admin set went back
    to the code's at the next deploy, and a tool renamed failed the running jobs' calls of it
    (tool_not_found) until then. Enabled, its queue and approvals are the admin's, and change."""
    demo = Toolset.objects.get(key="demo", owner=None)
    before = sorted(demo.tools.values_list("name", "price", "input_schema"))
    assert "is a builtin toolset" in admin_client.get(f"/admin/tools/toolset/{demo.pk}/change/").content.decode()
    form = {**_change_form(demo), "price": "7", "name": "Renamed", "requires_approval": "on"}
    form.update({"tools-0-name": "renamed", "tools-0-price": "9", "tools-0-timeout": "30"})
    try:
        saved = admin_client.post(f"/admin/tools/toolset/{demo.pk}/change/", form)
        assert saved.status_code == 302, saved.content.decode()[:3000]
        demo.refresh_from_db()
        assert (demo.price, demo.kind, demo.name, demo.requires_approval) == (1, "builtin", "Demo", True)
        assert sorted(demo.tools.values_list("name", "price", "input_schema")) == before
        assert demo.tools.order_by("name").first().timeout == 30  # type: ignore[union-attr]
        add = demo.tools.get(name="add")
        page = admin_client.post(f"/admin/tools/tool/{add.pk}/change/", {"name": "plus", "price": "5", "enabled": "on"})
        assert page.status_code == 302
        add.refresh_from_db()
        assert (add.name, add.price) == ("add", None)
        # Nor is one made here: builtins are defined in code.
        key = unique_key("builtin")
        made = {**_form(key, "forecast", ""), "kind": "builtin", "config": "{}", "tools-0-http": ""}
        page = admin_client.post("/admin/tools/toolset/add/", made)
        assert page.status_code == 200 and "Builtin toolsets are defined in code" in page.content.decode()
        assert not Toolset.objects.filter(key=key).exists()
    finally:
        Toolset.objects.filter(pk=demo.pk).update(requires_approval=False)
        demo.tools.update(timeout=None)


def test_the_toolset_list_makes_as_many_queries_for_many_owners_as_for_a_few(admin_client: Client) -> None:
    """The list shows each toolset's owner, a relation that may be null, which Django's own joins
    don't follow: each owned toolset on the page was a query of its own (30 more, 30 more queries)."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    prefix = unique_key("owned")

    def queries() -> int:
        with CaptureQueriesContext(connection) as made:
            assert admin_client.get("/admin/tools/toolset/", {"q": prefix}).status_code == 200
        return len(made)

    def owned(n: int) -> None:
        for _ in range(n):
            owner = get_user_model().objects.create_user(username=f"owner-{uuid.uuid4().hex[:8]}")
            Toolset.objects.create(key=f"{prefix}_{uuid.uuid4().hex[:6]}", name="mine", kind="http", owner=owner, is_global=False)

    try:
        owned(2)
        few = queries()
        owned(30)
        assert queries() == few
    finally:
        Toolset.objects.filter(key__startswith=prefix).delete()
