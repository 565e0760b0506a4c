"""The toolset API: reads with signatures, staff writes, validation with nothing half-saved, shadowing,
definitions export, the SDK by hash, and discovery inside the sandbox."""

import json
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from tests.conftest import Api
from tests.tools.conftest import unique_key
from tools.models import Tool, Toolset
from tools.sdk import class_name

FORECAST = {
    "name": "forecast",
    "description": "The forecast for a city. Days ahead are optional.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"],
    },
    "output_schema": {"type": "object", "properties": {"city": {"type": "string"}, "celsius": {"type": "number"}}},
    "read_only": True,
    "http": {"method": "GET", "path": "/forecast/{city}", "query": ["days"]},
}


def weather_body(key: str, secret: str = "s3cret-value", **extra: Any) -> dict[str, Any]:
    return {
        "key": key,
        "name": "Weather",
        "description": "Weather by city.",
        "kind": "http",
        "price": 2,
        "config": {"base_url": "http://127.0.0.1:9", "headers": {"X-Key": "{{secrets.WEATHER_KEY}}"}, "timeout": 5},
        "secrets": {"WEATHER_KEY": secret},
        "tools": [FORECAST],
        **extra,
    }


def test_toolsets_list_each_tool_with_its_signature(api: Api) -> None:
    toolsets = {ts["key"]: ts for ts in api.get("/api/v1/toolsets").json()}
    tools = {t["name"]: t for t in toolsets["demo"]["tools"]}
    assert tools["add"]["signature"] == "add(a: number, b: number) -> number"
    assert tools["catalog_search"]["signature"] == "catalog_search(query: str, category?: str, limit?: int) -> list"
    assert tools["add"]["ptc"] is True
    one = api.get("/api/v1/toolsets/demo")
    assert one.status_code == 200 and one.json()["key"] == "demo"
    missing = api.get("/api/v1/toolsets/no_such_toolset")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"


def test_only_staff_may_write(api: Api) -> None:
    response = api.post("/api/v1/toolsets", json=weather_body(unique_key("nostaff")))
    assert response.status_code == 403
    assert response.json()["error"]["code"] == "permission_denied"
    assert api.http.delete("/api/v1/toolsets/demo").status_code == 403


def test_staff_creates_changes_and_deletes_a_toolset(staff: Api) -> None:
    key = unique_key("weather")
    created = staff.post("/api/v1/toolsets", json=weather_body(key))
    assert created.status_code == 201, created.text
    body = created.json()
    assert body["secret_names"] == ["WEATHER_KEY"] and "secrets" not in body
    assert body["tools"][0]["signature"] == "forecast(city: str, days?: int) -> dict"

    patched = staff.http.patch(f"/api/v1/toolsets/{key}", json={"price": 5, "secrets": {"OTHER": "x-value"}})
    assert patched.status_code == 200, patched.text
    assert patched.json()["price"] == 5 and patched.json()["secret_names"] == ["OTHER", "WEATHER_KEY"]

    echo = {"name": "echo_it", "input_schema": {"type": "object", "properties": {"v": {"type": "string"}}}}
    echo["http"] = {"method": "POST", "path": "/items", "query": []}
    replaced = staff.http.put(f"/api/v1/toolsets/{key}", json=weather_body(key, tools=[echo]))
    assert replaced.status_code == 200, replaced.text
    assert [t["name"] for t in replaced.json()["tools"]] == ["echo_it"]
    assert replaced.json()["secret_names"] == ["WEATHER_KEY"]  # PUT replaced them
    # The old tool is disabled, not deleted: calls recorded against it keep their row.
    assert Tool.objects.get(toolset__key=key, name="forecast").enabled is False

    assert staff.post("/api/v1/toolsets", json=weather_body(key)).status_code == 409
    assert staff.http.delete(f"/api/v1/toolsets/{key}").status_code == 204
    assert staff.get(f"/api/v1/toolsets/{key}").status_code == 404


def test_builtin_toolsets_are_defined_in_code(staff: Api) -> None:
    create = staff.post("/api/v1/toolsets", json={"key": unique_key("built"), "name": "B", "kind": "builtin"})
    assert create.status_code == 400 and create.json()["error"]["code"] == "builtin_toolset"
    edit = staff.http.patch("/api/v1/toolsets/demo", json={"price": 9})
    assert edit.status_code == 400 and edit.json()["error"]["code"] == "builtin_toolset"
    # The message names all it may change: an approval too (it named only enabled and queue).
    assert "only 'enabled', 'queue', 'requires_approval' can change here, not price." in edit.json()["error"]["message"]
    assert staff.http.delete("/api/v1/toolsets/demo").status_code == 400
    assert Toolset.objects.get(key="demo", owner=None).price == 1


def _with_tool(key: str, **changes: Any) -> dict[str, Any]:
    return weather_body(key, tools=[{**FORECAST, **changes}])


BAD_DEFINITIONS = {
    "invalid_json_schema": (
        {"input_schema": {"type": "object", "properties": {"city": {"type": "town"}}}},
        "tools[0].input_schema",
    ),
    "invalid_tool_name": ({"name": "get-forecast"}, "tools[0].name"),
    "unknown_http_parameter": ({"http": {"method": "GET", "path": "/forecast/{town}", "query": ["days"]}}, "tools[0].http.path"),
}


@pytest.mark.parametrize("code", sorted(BAD_DEFINITIONS))
def test_a_bad_definition_is_refused_whole(staff: Api, code: str) -> None:
    changes, field = BAD_DEFINITIONS[code]
    key = unique_key("bad")
    response = staff.post("/api/v1/toolsets", json=_with_tool(key, **changes))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == code
    assert field in error["details"] and "Nothing was saved" in error["message"]
    assert not Toolset.objects.filter(key=key).exists()

    # An edit with the same mistake leaves the toolset as it was.
    assert staff.post("/api/v1/toolsets", json=weather_body(key)).status_code == 201
    edit = staff.http.patch(f"/api/v1/toolsets/{key}", json={"price": 7, "tools": [{**FORECAST, **changes}]})
    assert edit.status_code == 400 and edit.json()["error"]["code"] == code
    after = staff.get(f"/api/v1/toolsets/{key}").json()
    assert after["price"] == 2 and [t["name"] for t in after["tools"]] == ["forecast"]
    staff.http.delete(f"/api/v1/toolsets/{key}")


def _nested(depth: int) -> str:
    return "[" * (depth - 1) + "{}" + "]" * (depth - 1)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ('"price": 2147483648', "price"),  # past the column's range: was a 500 from PostgreSQL
        ('"price": 1e30', "price"),
        ('"tools": [{"name": "t", "price": 2147483648}]', "tools"),
        ('"tools": [{"name": "t", "timeout": true}]', "tools"),  # a boolean is not 1 second
        ('"tools": [{"name": "t", "timeout": 1e30}]', "tools"),
        ('"config": ' + _nested(101), "config"),  # readers of a value this deep recurse
        ('"tools": [{"name": "t", "input_schema": ' + _nested(900) + "}]", "tools"),
    ],
)
def test_numbers_out_of_range_and_values_nested_too_deep_are_field_errors(staff: Api, change: str, field: str) -> None:
    key = unique_key("bounds")
    body = '{"key": "' + key + '", "name": "B", "kind": "http", ' + change + "}"
    response = staff.post("/api/v1/toolsets", content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "validation_error"
    assert set(error["details"]) == {field}
    assert not Toolset.objects.filter(key=key).exists()


@pytest.mark.parametrize(
    ("path", "status"),
    [
        ("/api/v1/toolsets/%00", 404),  # PostgreSQL refuses a NUL: this was a 500
        ("/api/v1/toolsets/de%00mo", 404),
        ("/api/v1/toolsets/%00/sync", 404),
        ("/api/v1/toolsets/export-definitions?toolset_keys=%00", 400),
        ("/api/v1/sdk?toolset_keys=demo,%00", 400),
    ],
)
def test_a_nul_in_a_path_or_query_is_refused_not_a_500(staff: Api, path: str, status: int) -> None:
    response = staff.get(path) if not path.endswith("sync") else staff.post(path)
    assert response.status_code == status, response.text
    assert response.json()["error"]["code"] == ("not_found" if status == 404 else "validation_error")


def test_config_must_name_secrets_it_has(staff: Api) -> None:
    body = weather_body(unique_key("nosecret"))
    body["secrets"] = {}
    response = staff.post("/api/v1/toolsets", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "unknown_secret"


def test_a_users_own_toolset_shadows_the_global_one(make_api: Callable[..., Api]) -> None:
    owner, other = make_api(), make_api()
    key = unique_key("shadow")
    schema = {"type": "object", "properties": {}}
    spec = {"method": "GET", "path": "/x", "query": []}
    global_ts = Toolset.objects.create(key=key, name="Global", kind="http", config={"base_url": "http://127.0.0.1:9"})
    Tool.objects.create(toolset=global_ts, name="global_tool", input_schema=schema, http=spec)
    user = get_user_model().objects.get(username=owner.username)
    own = Toolset.objects.create(
        key=key, name="Own", kind="http", owner=user, is_global=False, config={"base_url": "http://127.0.0.1:9"}
    )
    Tool.objects.create(toolset=own, name="own_tool", input_schema=schema, http=spec)

    assert [t["name"] for t in owner.get(f"/api/v1/toolsets/{key}").json()["tools"]] == ["own_tool"]
    assert [t["name"] for t in other.get(f"/api/v1/toolsets/{key}").json()["tools"]] == ["global_tool"]
    code = f"from ptc_tools.{key} import {class_name(key)} as T\n[n for n in vars(T) if not n.startswith('_')]"
    assert owner.run(code, toolsets=[key])["return_value"] == ["own_tool"]
    assert other.run(code, toolsets=[key])["return_value"] == ["global_tool"]
    own.delete()
    global_ts.delete()


def test_export_definitions(api: Api) -> None:
    response = api.get("/api/v1/toolsets/export-definitions", params={"toolset_keys": "demo"})
    assert response.status_code == 200, response.text
    (demo,) = response.json()["toolsets"]
    assert demo["key"] == "demo" and demo["name"] == "Demo"
    add = next(t for t in demo["tools"] if t["name"] == "add")
    assert add["input_schema"]["required"] == ["a", "b"] and add["output_schema"] == {"type": "number"}
    unknown = api.get("/api/v1/toolsets/export-definitions", params={"toolset_keys": "demo,nope"})
    assert unknown.status_code == 400 and unknown.json()["error"]["code"] == "unknown_toolset"


def test_secrets_never_leave_the_server(staff: Api, api: Api) -> None:
    secret = f"sk-{uuid.uuid4().hex}"
    key = unique_key("secretive")
    assert staff.post("/api/v1/toolsets", json=weather_body(key, secret=secret)).status_code == 201
    seen = [
        staff.get("/api/v1/toolsets").text,
        staff.get(f"/api/v1/toolsets/{key}").text,
        api.get("/api/v1/toolsets/export-definitions", params={"toolset_keys": key}).text,
        api.get("/api/v1/sdk", params={"toolset_keys": key}).text,
        api.post("/api/v1/ptc/context", json={"toolsets": [key]}).text,
        json.dumps(
            api.run(
                "import ptc_tools, pathlib\nprint(pathlib.Path(ptc_tools.__file__).parent.joinpath('_catalog.json').read_text())",
                toolsets=[key],
            )
        ),
    ]
    admin = get_user_model().objects.create_user(username=f"admin-{uuid.uuid4().hex[:6]}", is_staff=True, is_superuser=True)
    client = Client()
    client.force_login(admin)
    toolset = Toolset.objects.get(key=key)
    page = client.get(f"/admin/tools/toolset/{toolset.pk}/change/")
    assert page.status_code == 200
    seen.append(page.content.decode())
    assert "WEATHER_KEY" in seen[-1]  # its name is shown; its value never is
    for text in seen:
        assert secret not in text
    staff.http.delete(f"/api/v1/toolsets/{key}")


def test_the_sdk_by_hash(api: Api) -> None:
    first = api.get("/api/v1/sdk", params={"toolset_keys": "demo"}).json()
    second = api.get("/api/v1/sdk", params={"toolset_keys": "demo"}).json()
    assert first["hash"] == second["hash"] and len(first["hash"]) == 64
    demo = first["files"]["ptc_tools/demo.py"]
    # Typed returns: the shape from the output schema, not Any.
    assert "def _sleep(*, ms: int) -> SleepResult:" in demo
    assert (
        "def _catalog_search(*, query: str, category: str = _rt.UNSET, limit: int = _rt.UNSET) -> list[CatalogSearchResultItem]:"
        in demo
    )
    assert "list[{category?: str, id?: str, name?: str, price?: number, stock?: int}]" in demo
    assert "ptc_tools/_catalog.json" in first["files"] and "ptc_tools/_discovery.py" in first["files"]
    assert "`Demo.add(a: number, b: number) -> number`" in first["docs"]["demo"]
    job = api.run("from ptc_tools.demo import Demo\nDemo.add(a=1, b=2)", toolsets=["demo"])
    assert job["sdk_hash"] == first["hash"]


def test_describe_and_search_inside_the_sandbox(api: Api) -> None:
    code = (
        "import ptc_tools\n"
        "print(ptc_tools.describe('demo.catalog_search'))\n"
        "doc = ptc_tools.describe('Demo.sleep')\n"
        "assert doc['output_schema']['properties']['slept_ms'] == {'type': 'integer'}\n"
        "try:\n    ptc_tools.describe('demo.nope')\nexcept LookupError as e:\n    print('missing:', e)\n"
        "ptc_tools.search('product catalog')"
    )
    job = api.run(code, toolsets=["demo"])
    assert job["status"] == "completed", job["error"]
    assert "demo.catalog_search(query: str, category?: str, limit?: int) -> list" in job["stdout"]
    assert '"jewelry"' in job["stdout"] and "input_schema:" in job["stdout"]
    assert "missing: no tool 'demo.nope'" in job["stdout"]
    assert job["return_value"][0].startswith("demo.catalog_search(query: str")


def test_a_toolsets_config_is_shown_to_staff_and_its_owner_only(
    api: Api, staff: Api, create_toolset: Callable[..., dict[str, Any]]
) -> None:
    """A global toolset's config holds the operator's internals (an MCP server's command and
    environment, an upstream's host): every tenant uses its tools, none reads its config."""
    key = f"internal_{uuid.uuid4().hex[:6]}"
    config = {"base_url": "http://10.0.0.7:8001", "headers": {"X-Key": "{{secrets.K}}"}}
    tool = {"name": "forecast", "input_schema": {"type": "object"}, "http": {"method": "GET", "path": "/", "query": []}}
    create_toolset({"key": key, "name": "Internal", "kind": "http", "config": config, "secrets": {"K": "s"}, "tools": [tool]})
    assert staff.get(f"/api/v1/toolsets/{key}").json()["config"] == config
    seen = api.get(f"/api/v1/toolsets/{key}").json()
    assert (seen["config"], seen["secret_names"], [t["name"] for t in seen["tools"]]) == (None, ["K"], ["forecast"])
    assert next(t for t in api.get("/api/v1/toolsets").json() if t["key"] == key)["config"] is None

    own = Toolset.objects.create(
        key=f"own_{uuid.uuid4().hex[:6]}",
        name="Own",
        kind="http",
        owner=get_user_model().objects.get(username=api.username),
        is_global=False,
        config=config,
    )
    assert api.get(f"/api/v1/toolsets/{own.key}").json()["config"] == config


def test_a_client_toolset_or_tool_can_not_require_an_approval(staff: Api) -> None:
    """Its caller runs a client tool, not a worker here: an approval could gate nothing, and the flag
    was kept and never acted on. Refused where it is written, the API and the admin alike."""
    from tools.admin import ToolsetForm
    from tools.validation import CLIENT_NOT_GATED

    confirm = {"name": "confirm", "input_schema": {"type": "object", "properties": {}}}
    key = unique_key("app_ui")
    body = {"key": key, "name": "App UI", "kind": "client", "tools": [confirm]}
    for bad, field in (
        ({**body, "requires_approval": True}, "requires_approval"),
        ({**body, "tools": [{**confirm, "requires_approval": True}]}, "tools[0].requires_approval"),
    ):
        refused = staff.post("/api/v1/toolsets", json=bad)
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["code"] == "validation_error"
        assert "run by the job's caller" in error["details"][field][0]
    assert not Toolset.objects.filter(key=key).exists()
    assert staff.post("/api/v1/toolsets", json=body).status_code == 201
    try:
        changed = staff.http.patch(f"/api/v1/toolsets/{key}", json={"requires_approval": True})
        assert changed.status_code == 400 and "requires_approval" in changed.json()["error"]["details"]
        assert Toolset.objects.get(key=key).requires_approval is False
        toolset = Toolset.objects.get(key=key)
        form = ToolsetForm(
            data={"key": key, "name": "App UI", "kind": "client", "is_global": True, "queue": "tools", "requires_approval": True},
            instance=toolset,
        )
        form.fields.pop("key", None)
        assert not form.is_valid()
        assert form.errors["requires_approval"] == [CLIENT_NOT_GATED]
    finally:
        staff.http.delete(f"/api/v1/toolsets/{key}")
