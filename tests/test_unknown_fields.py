"""A request body's keys are its fields: a misspelled key is a 400 that names it, not a setting left
at its default without a word (a `max_credit` that leaves the job uncapped, a `toolset` that grants
every toolset)."""

import pytest

from tests.conftest import Api
from tests.tools.conftest import unique_key
from tests.tools.test_toolsets_api import weather_body


@pytest.mark.parametrize(
    ("body", "unknown"),
    [
        ({"code": "1", "toolset": ["demo"]}, "toolset"),
        ({"code": "1", "toolsets": ["demo"], "max_credit": 1}, "max_credit"),
        ({"code": "1", "toolsets": ["demo"], "timeout_seconds": 1}, "timeout_seconds"),
    ],
)
def test_a_misspelled_key_of_a_job_is_a_field_error_and_no_job_is_made(api: Api, body: dict, unknown: str) -> None:
    response = api.post("/api/v1/exec", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "validation_error"
    assert list(error["details"]) == [unknown]
    assert "Unknown field: not one of code, toolsets, timeout, wait, title, max_credits" in error["details"][unknown][0]
    assert api.get("/api/v1/exec").json()["results"] == []


def test_a_body_of_many_unknown_keys_names_a_few_of_them_shortened(api: Api) -> None:
    body = {"code": "1", **{f"{i:05}{'k' * 100}": i for i in range(1_000)}}
    response = api.post("/api/v1/exec", json=body)
    assert response.status_code == 400
    details = response.json()["error"]["details"]
    assert sorted(details) == [f"{i:05}{'k' * 59}" for i in range(10)]
    assert len(response.content) < 5_000


@pytest.mark.parametrize(
    ("path", "body", "unknown"),
    [
        ("/api/v1/sessions", {"toolset": ["demo"]}, "toolset"),
        ("/api/v1/sessions", {"limits": {"memory": 64}}, "limits"),  # nested: the field is named
        ("/api/v1/keys", {"name": "ci", "expires": "2030-01-01T00:00:00Z"}, "expires"),
        ("/api/v1/ptc/context", {"toolset": ["demo"]}, "toolset"),
        ("/api/v1/tools/execute", {"toolset": "demo", "tool": "echo", "args": {"text": "hi"}}, "args"),
    ],
)
def test_each_body_a_user_sends_refuses_unknown_keys(api: Api, path: str, body: dict, unknown: str) -> None:
    response = api.post(path, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "validation_error"
    assert list(response.json()["error"]["details"]) == [unknown]


def test_a_misspelled_key_of_a_session_upload_is_a_field_error_and_nothing_is_stored(api: Api) -> None:
    # A multipart body is a body too: with "paht" dropped, the file was stored under its upload's
    # name, not where it was meant to go, and the code found it elsewhere (or an older one there).
    session = api.post("/api/v1/sessions", json={"toolsets": ["demo"]}).json()
    url = f"/api/v1/sessions/{session['id']}/files"
    response = api.post(url, files={"file": ("prices.csv", b"a,b\n")}, data={"paht": "data/prices.csv"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "validation_error"
    assert list(response.json()["error"]["details"]) == ["paht"]
    assert api.get(url).json()["results"] == []
    # A browser's form, signed in to the admin, carries its CSRF token as a field: that one is known.
    stored = api.post(url, files={"file": ("prices.csv", b"a,b\n")}, data={"path": "data/p.csv", "csrfmiddlewaretoken": "t"})
    assert stored.status_code == 201, stored.text
    assert [f["path"] for f in api.get(url).json()["results"]] == ["data/p.csv"]
    assert api.http.delete(f"/api/v1/sessions/{session['id']}").status_code == 200


def test_staff_bodies_refuse_unknown_keys_and_change_nothing(staff: Api) -> None:
    before = staff.get("/api/v1/policy").json()
    response = staff.http.patch("/api/v1/policy", json={"toolset_blocklst": ["demo"]})
    assert response.status_code == 400, response.text
    assert list(response.json()["error"]["details"]) == ["toolset_blocklst"]
    assert staff.get("/api/v1/policy").json() == before

    response = staff.post("/api/v1/billing/credits", json={"username": staff.username, "ammount": 5, "reason": "x"})
    assert response.status_code == 400
    assert set(response.json()["error"]["details"]) == {"ammount", "amount"}  # the missing one too

    key = unique_key("weather")
    response = staff.post("/api/v1/toolsets", json=weather_body(key, requires_aproval=True))
    assert response.status_code == 400
    assert list(response.json()["error"]["details"]) == ["requires_aproval"]
    # A tool's too: an MCP server's spelling (inputSchema) left the tool without its schema.
    tool = {"name": "forecast", "inputSchema": {"type": "object"}, "http": {"method": "GET", "path": "/f"}}
    response = staff.post("/api/v1/toolsets", json=weather_body(key, tools=[tool]))
    assert response.status_code == 400
    assert "inputSchema" in response.json()["error"]["details"]["tools"]["0"]
    assert staff.get(f"/api/v1/toolsets/{key}").status_code == 404


def test_a_toolset_as_read_may_be_written_back(staff: Api) -> None:
    # Read, changed, sent back whole: the keys only a read has (secret_names, created_at, ...) are ignored.
    key = unique_key("weather")
    assert staff.post("/api/v1/toolsets", json=weather_body(key)).status_code == 201
    shown = staff.get(f"/api/v1/toolsets/{key}").json()
    response = staff.http.put(f"/api/v1/toolsets/{key}", json={**shown, "price": 7})
    assert response.status_code == 200, response.text
    assert response.json()["price"] == 7 and response.json()["secret_names"] == ["WEATHER_KEY"]
    assert staff.http.delete(f"/api/v1/toolsets/{key}").status_code == 204


def test_the_openapi_document_says_so(api: Api) -> None:
    schemas = api.get("/api/schema/", headers={"Accept": "application/json"}).json()["components"]["schemas"]
    assert schemas["ExecCreateRequest"]["additionalProperties"] is False
    assert schemas["PatchedPolicyRequest"]["additionalProperties"] is False
    assert "additionalProperties" not in schemas["ClientToolRequest"]  # Anthropic's tool definitions, as they come
    assert "additionalProperties" not in schemas["ExecJob"]  # answers may grow
    # The mixin's docstring (how it works, for this code's readers) is no body's description: each
    # body without a docstring of its own, and the policy as GET answers it, took it.
    described = [name for name, schema in schemas.items() if "mixed into a serializer" in schema.get("description", "")]
    assert described == []
