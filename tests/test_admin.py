import uuid

from django.contrib.auth import get_user_model
from django.test import Client

from tests.conftest import Api


def test_admin_pages_render_for_staff(api: Api) -> None:
    job = api.run("from ptc_tools.demo import Demo\nprint('hi')\nDemo.add(a=1, b=2)", toolsets=["demo"])
    staff = get_user_model().objects.create_user(username=f"admin-{uuid.uuid4().hex[:6]}", is_staff=True, is_superuser=True)
    client = Client()
    client.force_login(staff)
    pages = [
        "/admin/",
        "/admin/execution/execjob/",
        "/admin/execution/execjob/?status__exact=completed",
        f"/admin/execution/execjob/{job['id']}/change/",
        "/admin/execution/toolcall/",
        "/admin/tools/toolset/",
        "/admin/tools/tool/",
        "/admin/accounts/apikey/",
        "/admin/accounts/apikey/add/",
    ]
    for page in pages:
        response = client.get(page)
        assert response.status_code == 200, page
    detail = client.get(f"/admin/execution/execjob/{job['id']}/change/").content.decode()
    assert job["call_id"] in detail
    assert "<span>print(&#x27;hi&#x27;)</span>" in detail  # the code, a line per row
    assert job["tool_calls"][0]["call_id"] in detail


def test_admin_is_closed_to_non_staff(api: Api) -> None:
    user = get_user_model().objects.get(username=api.username)
    client = Client()
    client.force_login(user)
    assert client.get("/admin/execution/execjob/").status_code == 302
