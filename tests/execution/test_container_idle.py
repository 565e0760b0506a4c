"""Managed containers' jobs closed once idle, on a deployment of their own whose idle time is two
seconds (PTC_CONTAINER_IDLE_SECONDS): its exec worker's reaper (every second) closes them for real."""

import time
import uuid
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import psycopg
import pytest

from execution.models import ExecJob
from tests.conftest import Api, own_deployment
from tests.execution.client_loop import sse_events
from tests.servers import api_key
from tests.stack import Stack, free_port

IDLE = 2


@pytest.fixture(scope="module")
def idle_stack(stack_env: dict[str, str]) -> Iterator[Stack]:
    with own_deployment(stack_env, "container-idle", PTC_CONTAINER_IDLE_SECONDS=str(IDLE)) as stack:
        yield stack


@pytest.fixture
def idle_api(idle_stack: Stack) -> Iterator[Api]:
    username = f"idle-{free_port()}"
    client = Api(idle_stack.base_url, api_key(idle_stack.env, username), username)
    yield client
    client.http.close()


def _call(api: Api, container: str, ms: int) -> dict[str, Any]:
    body = {"toolset": "demo", "tool": "sleep", "arguments": {"ms": ms}, "container_id": container}
    body["caller"] = {"type": "code_execution_20260120", "tool_id": "srvtoolu_1"}
    answer = api.post("/api/v1/tools/execute", json=body)
    assert answer.status_code == 200 and answer.json()["status"] == "completed", answer.text
    return dict(answer.json())


def _job_id(api: Api) -> str:
    [job] = api.get("/api/v1/exec").json()["results"]  # the user's one job: the container's
    return str(job["id"])


def _ended(api: Api, job_id: str, seconds: float) -> dict[str, Any]:
    deadline = time.monotonic() + seconds
    while (job := api.get(f"/api/v1/exec/{job_id}").json())["status"] == "running":
        assert time.monotonic() < deadline, f"not closed within {seconds} s: {job}"
        time.sleep(0.1)
    return dict(job)


def _at(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def test_an_idle_containers_job_ends_when_it_was_last_used_not_when_it_was_closed(idle_api: Api) -> None:
    """A container's job closed idle had for its finished_at the close's time, its idle time and a
    reaper's round after its last call: its execution_time_seconds counted that hour of nothing.
    It now ends when its last call ended; closed only once idle, as before."""
    container = f"container_{uuid.uuid4().hex[:12]}"
    _call(idle_api, container, ms=0)
    _call(idle_api, container, ms=300)
    job_id = _job_id(idle_api)
    time.sleep(IDLE / 2)
    assert idle_api.get(f"/api/v1/exec/{job_id}").json()["status"] == "running"  # used a second ago
    job = _ended(idle_api, job_id, 15)
    assert (job["status"], job["success"]) == ("completed", True), job
    last = max(_at(call["finished_at"]) for call in job["tool_calls"])
    assert _at(job["finished_at"]) == last, job  # before: a close at least IDLE / 2 s after it
    assert job["execution_time_seconds"] == round((last - _at(job["started_at"])).total_seconds(), 4)
    assert job["execution_time_seconds"] < IDLE, job
    [end] = [data for name, data in sse_events(idle_api, job_id, timeout=15) if name == "exec_end"]
    assert (end["status"], end["finished_at"], end["execution_time_seconds"]) == (
        "completed",
        job["finished_at"],
        job["execution_time_seconds"],
    )


def test_a_containers_job_made_before_last_call_at_was_kept_is_closed_by_its_calls(idle_stack: Stack, idle_api: Api) -> None:
    """A container's job open when the migration adding ``last_call_at`` ran has none (and a web
    process not yet updated records calls without it): the reaper goes by its calls, so it is closed
    an idle time after its last call's end, not its first's (its start), and is kept from then on."""
    container = f"container_{uuid.uuid4().hex[:12]}"
    _call(idle_api, container, ms=0)
    _call(idle_api, container, ms=2500)
    job_id = _job_id(idle_api)
    table = ExecJob._meta.db_table
    with psycopg.connect(idle_stack.env["DATABASE_URL"], autocommit=True) as db:
        db.execute(f"UPDATE {table} SET last_call_at = NULL WHERE id = %s", [job_id])
        # Its start is past the idle time by now: gone by that, it was closed at the reaper's next round.
        time.sleep(IDLE * 0.75)
        assert idle_api.get(f"/api/v1/exec/{job_id}").json()["status"] == "running"
        kept = db.execute(f"SELECT last_call_at FROM {table} WHERE id = %s", [job_id]).fetchone()
    job = _ended(idle_api, job_id, 15)
    assert job["status"] == "completed", job
    last = max(_at(call["finished_at"]) for call in job["tool_calls"])
    assert kept is not None and kept[0] == last  # set from its calls by the reaper's first look
    assert _at(job["finished_at"]) == last, job
