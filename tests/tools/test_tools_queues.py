"""Per-toolset queues: a toolset routed to tools.slow runs only on a worker that serves tools.slow."""

import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from execution.backplane import backplane
from execution.models import ToolCall
from tests.conftest import Api
from tests.stack import BIN, Process
from tests.tools.conftest import unique_key
from tests.tools.http_api import HttpApi
from tools.sdk import class_name


@pytest.fixture(scope="module")
def http_api() -> Iterator[HttpApi]:
    with HttpApi(expected_key="") as server:
        yield server


def _toolset(key: str, url: str, **fields: Any) -> dict[str, Any]:
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    tool = {"name": "forecast", "input_schema": schema, "http": {"method": "GET", "path": "/forecast/{city}", "query": []}}
    return {"key": key, "name": "Slow weather", "kind": "http", "config": {"base_url": url}, "tools": [tool], **fields}


def test_unknown_queues_are_refused_at_write_time(staff: Api, http_api: HttpApi, create_toolset: Callable[..., Any]) -> None:
    key = unique_key("routed")
    refused = staff.post("/api/v1/toolsets", json=_toolset(key, http_api.url, queue="tools.nowhere"))
    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "validation_error"
    assert "queue" in refused.json()["error"]["details"]
    assert "tools.slow" in refused.json()["error"]["message"]  # says which queues exist
    assert staff.get(f"/api/v1/toolsets/{key}").status_code == 404  # nothing was created

    made = create_toolset(_toolset(key, http_api.url))
    assert made["queue"] == "tools"
    for queue in ("exec", "tools.nowhere"):
        patched = staff.http.patch(f"/api/v1/toolsets/{key}", json={"queue": queue})
        assert patched.status_code == 400, patched.text
    assert staff.get(f"/api/v1/toolsets/{key}").json()["queue"] == "tools"
    assert staff.http.patch(f"/api/v1/toolsets/{key}", json={"queue": "tools.slow"}).json()["queue"] == "tools.slow"
    # A builtin toolset can be routed too (its code is fixed; where it runs is the operator's).
    demo = staff.http.patch("/api/v1/toolsets/demo", json={"queue": "tools"})
    assert demo.status_code == 200, demo.text


def test_a_toolset_on_tools_slow_runs_only_on_a_tools_slow_worker(
    api: Api, http_api: HttpApi, create_toolset: Callable[..., Any], stack_env: dict[str, str]
) -> None:
    key = unique_key("slowq")
    create_toolset(_toolset(key, http_api.url, queue="tools.slow"))
    code = f"""
from ptc_tools.{key} import {class_name(key)}
from ptc_tools.demo import Demo
print(Demo.add(a=1, b=2))   # on the tools queue: served as usual
print({class_name(key)}.forecast(city="Oslo")["city"])
"""
    job = api.run(code, toolsets=["demo", key], wait=0, timeout=120)
    # The demo call runs on the tools worker; the routed one waits: no worker serves tools.slow yet.
    # It is announced (its start event) but not recorded: the worker that takes a call records it.
    deadline = time.monotonic() + 20
    while not (started := _started(job["call_id"], key)):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    time.sleep(3)
    routed_id = started[0]["call_id"]
    assert not ToolCall.objects.filter(call_id=routed_id).exists(), "a worker not on tools.slow took the call"
    assert ToolCall.objects.get(exec_job_id=job["id"], toolset_key="demo").status == "completed"

    # A small pool: PostgreSQL's connections are shared by every process of the test run.
    env = {**stack_env, "PTC_DB_POOL_MIN": "1", "PTC_DB_POOL_MAX": "4", "PTC_TOOLS_CONCURRENCY": "8"}
    worker = Process(
        f"tools-slow-worker-{uuid.uuid4().hex[:6]}",
        [
            str(BIN / "celery"),
            "-A",
            "ptcproject",
            "worker",
            "-Q",
            "tools.slow",
            "-n",
            f"slow-{uuid.uuid4().hex[:6]}@%h",
            "-l",
            "info",
        ],
        env,
        ready=" ready.",
    )
    worker.start()
    try:
        deadline = time.monotonic() + 30
        while (finished := api.get(f"/api/v1/exec/{job['id']}").json())["status"] in ("queued", "running"):
            assert time.monotonic() < deadline, "the tools.slow worker did not run the routed call"
            time.sleep(0.2)
        assert finished["status"] == "completed", finished
        assert finished["stdout"] == "3\nOslo\n"
        assert routed_id in worker.log.read_text()  # it ran there
        routed = ToolCall.objects.get(call_id=routed_id)
        assert (routed.status, routed.output["city"]) == ("completed", "Oslo")
        assert "concurrency: 8 (thread)" in worker.log.read_text()  # sized as a tools worker (PTC_TOOLS_CONCURRENCY)
    finally:
        worker.stop()


def _started(job_call_id: str, toolset: str) -> list[dict[str, Any]]:
    """The start events of the job's calls of ``toolset``, from its event log."""
    events = backplane().events_read(job_call_id)
    return [data for _, name, data in events if name == "tool_call_start" and data["toolset"] == toolset]


def test_the_admin_offers_only_the_deployments_queues() -> None:
    from django.contrib.auth import get_user_model
    from django.test import Client

    from tests.tools.test_admin_tools import _form
    from tools.models import Toolset

    staff = get_user_model().objects.create_user(username=f"admin-{uuid.uuid4().hex[:6]}", is_staff=True, is_superuser=True)
    client = Client()
    client.force_login(staff)
    key = unique_key("adminq")
    page = client.post("/admin/tools/toolset/add/", {**_form(key, "forecast", '{"KEY": "v"}'), "queue": "tools.nowhere"})
    assert page.status_code == 200 and "tools.nowhere is not one of the available choices" in page.content.decode()
    assert not Toolset.objects.filter(key=key).exists()
    made = client.post("/admin/tools/toolset/add/", {**_form(key, "forecast", '{"KEY": "v"}'), "queue": "tools"})
    assert made.status_code == 302
    assert Toolset.objects.get(key=key).queue == "tools"
    Toolset.objects.filter(key=key).delete()
