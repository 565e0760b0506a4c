"""A toolset changed while its calls wait in a queue: each call is billed as it was made, and is not run once its tool is disabled."""

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from billing.models import CreditUsage, Reservation
from tests.conftest import Api
from tests.stack import BIN, Process
from tests.tools.conftest import unique_key
from tests.tools.http_api import HttpApi
from tools.models import Tool
from tools.sdk import class_name


@pytest.fixture(scope="module")
def http_api() -> Iterator[HttpApi]:
    with HttpApi(expected_key="") as server:
        yield server


def _toolset(key: str, url: str) -> dict[str, Any]:
    city = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    return {
        "key": key,
        "name": "Priced",
        "kind": "http",
        "price": 5,
        "queue": "tools.slow",  # no worker takes it until the test starts one
        "config": {"base_url": url, "timeout": 5},
        "tools": [
            {"name": "forecast", "input_schema": city, "http": {"method": "GET", "path": "/forecast/{city}", "query": []}},
            {"name": "boom", "input_schema": city, "http": {"method": "GET", "path": "/explode/{city}", "query": []}},
        ],
    }


@contextmanager
def _queued(api: Api, staff: Api, key: str, code: str, *, calls: int, stack_env: dict[str, str]) -> Iterator[Callable[[], Any]]:
    """Run ``code`` with the toolset ``key`` until its ``calls`` calls are priced, held and queued on
    tools.slow, where no worker takes them; yield a function that starts that queue's worker and
    returns the job once it has ended. The worker is stopped and the toolset deleted after."""
    name = f"tools-{key}"
    worker = Process(
        name,
        [str(BIN / "celery"), "-A", "ptcproject", "worker", "-Q", "tools.slow", "-n", f"{name}@%h", "-l", "info"],
        {**stack_env, "PTC_TOOLS_CONCURRENCY": "4"},
        ready=" ready.",
    )

    def ended() -> Any:
        worker.start()
        deadline = time.monotonic() + 60
        while (job := api.get(f"/api/v1/exec/{job_id}").json())["status"] in ("queued", "running"):
            assert time.monotonic() < deadline, "the job did not end"
            time.sleep(0.2)
        return job

    try:
        job_id = api.run(code, toolsets=[key], wait=0, timeout=60)["id"]
        deadline = time.monotonic() + 20
        while _held(api).count() < calls:
            assert time.monotonic() < deadline, "the job's calls were not held"
            time.sleep(0.1)
        yield ended
    finally:
        worker.stop()
        staff.http.delete(f"/api/v1/toolsets/{key}")


def _held(api: Api) -> Any:
    return Reservation.objects.filter(account__user__username=api.username, status=Reservation.Status.HELD)


@pytest.mark.parametrize("change", [{"billing_free": True}, {"is_global": False}])
def test_a_call_queued_before_its_toolset_turned_free_is_settled_or_released_as_it_ends(
    api: Api, staff: Api, http_api: HttpApi, stack_env: dict[str, str], change: dict[str, Any]
) -> None:
    key = unique_key("priced")
    assert staff.post("/api/v1/toolsets", json=_toolset(key, http_api.url)).status_code == 201
    cls = class_name(key)
    code = f"""
from concurrent.futures import ThreadPoolExecutor
from ptc_tools import ToolError
from ptc_tools.{key} import {cls}
def call(name):
    try:
        return getattr({cls}, name)(city="x") and "ok"
    except ToolError as e:
        return e.code
with ThreadPoolExecutor(2) as pool:
    out = list(pool.map(call, ["forecast", "boom"]))
out
"""
    with _queued(api, staff, key, code, calls=2, stack_env=stack_env) as ended:
        assert staff.http.patch(f"/api/v1/toolsets/{key}", json=change).status_code == 200
        job = ended()
        assert job["status"] == "completed" and job["return_value"] == ["ok", "http_error"], job
        # At the job's end, not a lease and a reap later: the completed call charged what was held
        # for it as it was made, the failed one given back.
        assert not _held(api).exists()
        assert job["credits_charged"] == 5
        assert CreditUsage.objects.filter(user__username=api.username).count() == 1
        assert api.get("/api/v1/billing/balance").json()["reserved"] == 0


@pytest.mark.parametrize("disable", ["toolset", "tool"])
def test_a_call_queued_before_its_tool_was_disabled_is_not_run(
    api: Api, staff: Api, http_api: HttpApi, stack_env: dict[str, str], disable: str
) -> None:
    """Disabled in the admin (or PATCH enabled: false) because it misbehaves, a toolset or tool is
    not run again: the calls of running jobs that no tools worker had started yet ran all the same,
    and were charged. They now fail tool_disabled, their price given back."""
    key = unique_key("disabled")
    assert staff.post("/api/v1/toolsets", json=_toolset(key, http_api.url)).status_code == 201
    cls = class_name(key)
    code = f"""
from ptc_tools import ToolError
from ptc_tools.{key} import {cls}
try:
    out = [None, {cls}.forecast(city="x")]
except ToolError as e:
    out = [e.code, e.message]
out
"""
    with _queued(api, staff, key, code, calls=1, stack_env=stack_env) as ended:
        if disable == "toolset":
            assert staff.http.patch(f"/api/v1/toolsets/{key}", json={"enabled": False}).status_code == 200
        else:  # the tool's admin page, "enabled" unticked
            Tool.objects.filter(toolset__key=key, name="forecast").update(enabled=False)
        job = ended()
        assert job["status"] == "completed" and job["return_value"][0] == "tool_disabled", job
        assert "disabled" in job["return_value"][1]
        assert job["credits_charged"] == 0 and not _held(api).exists()
        assert api.get("/api/v1/billing/balance").json()["reserved"] == 0
