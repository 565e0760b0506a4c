"""/metrics on the real stack: who may read it, the events of every process, and the fleet's state."""

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from django.contrib.auth import get_user_model
from django.utils import timezone
from prometheus_client import CollectorRegistry, multiprocess
from prometheus_client.parser import text_string_to_metric_families

from billing.models import Reservation
from execution.models import ExecJob, ToolCall
from tests.conftest import METRICS_TOKEN, Api
from tests.factories import running_job
from tests.stack import ROOT, Stack
from tests.tools.conftest import unique_key
from tests.tools.http_api import HttpApi
from tools.sdk import class_name


def scrape(stack: Stack, token: str = METRICS_TOKEN) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Return every sample of /metrics: (name, sorted labels) -> value."""
    response = httpx.get(f"{stack.base_url}/metrics", headers={"Authorization": f"Bearer {token}"}, timeout=30)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_only_the_token_or_staff_may_read_metrics(stack: Stack, make_api: Callable[..., Api]) -> None:
    url = f"{stack.base_url}/metrics"
    assert httpx.get(url).status_code == 401
    assert httpx.get(url, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(url, headers={"Authorization": f"Bearer {make_api().key}"}).status_code == 401  # not staff
    assert httpx.get(url, headers={"Authorization": f"Bearer {make_api(staff=True).key}"}).status_code == 200
    assert scrape(stack)  # the token


def test_job_and_call_metrics_come_from_the_workers(stack: Stack, api: Api) -> None:
    before = scrape(stack)
    job = api.run("from ptc_tools.demo import Demo\nprint(Demo.add(a=1, b=2))", toolsets=["demo"])
    assert job["status"] == "completed"
    failed = api.run("raise ValueError('no')")
    assert failed["status"] == "failed"
    deadline = time.monotonic() + 10
    while True:  # the exec worker counts the job right after it records its end
        after = scrape(stack)
        if value(after, "ptc_jobs_finished_total", status="failed") > value(before, "ptc_jobs_finished_total", status="failed"):
            break
        assert time.monotonic() < deadline
        time.sleep(0.2)
    grew = lambda name, **labels: value(after, name, **labels) - value(before, name, **labels)  # noqa: E731
    assert grew("ptc_jobs_finished_total", status="completed") >= 1
    assert grew("ptc_job_duration_seconds_count", toolset="demo", status="completed") >= 1
    for toolset in failed["toolsets"] or ["-"]:  # once per toolset it was granted ("-": none)
        assert grew("ptc_job_duration_seconds_count", toolset=toolset, status="failed") >= 1
    assert grew("ptc_tool_call_duration_seconds_count", toolset="demo", outcome="ok") >= 1
    assert grew("ptc_sandbox_start_seconds_count") >= 2
    assert value(after, "ptc_sandbox_start_seconds_sum") > 0
    # Live workers per queue, from their presence beats.
    assert value(after, "ptc_queue_workers", queue="exec") >= 1
    assert value(after, "ptc_queue_workers", queue="tools") >= 1
    assert ("ptc_queue_depth", (("queue", "exec"),)) in after
    assert value(after, "ptc_fleet_up", source="database") == value(after, "ptc_fleet_up", source="broker") == 1


@pytest.fixture(scope="module")
def http_api() -> Iterator[HttpApi]:
    with HttpApi(expected_key="") as server:
        yield server


def test_fleet_state_shows_a_call_waiting_on_a_queue_no_worker_serves(
    stack: Stack, api: Api, http_api: HttpApi, make_api: Callable[..., Api]
) -> None:
    key = unique_key("stuck")
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    tool = {"name": "forecast", "input_schema": schema, "http": {"method": "GET", "path": "/forecast/{city}", "query": []}}
    body = {"key": key, "name": "Stuck", "kind": "http", "config": {"base_url": http_api.url}, "tools": [tool]}
    made = make_api(staff=True).post("/api/v1/toolsets", json={**body, "queue": "tools.slow", "price": 2})
    assert made.status_code == 201, made.text
    job = api.run(f"from ptc_tools.{key} import {class_name(key)}\n{class_name(key)}.forecast(city='x')", toolsets=[key], wait=0)
    # Its own call held and queued: tools.slow may hold other tests' calls already (no worker of the
    # test stack serves it), so its depth alone was no sign that this call had got that far.
    deadline = time.monotonic() + 20
    while not (
        Reservation.objects.filter(exec_job_id=job["id"], status="held").exists()
        and value(samples := scrape(stack), "ptc_queue_depth", queue="tools.slow")
    ):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    try:
        # Queued, not taken: counted in its queue's depth; a call is in flight once a worker takes it.
        assert value(samples, "ptc_tool_calls_in_flight", toolset=key) == 0
        assert value(samples, "ptc_queue_workers", queue="tools.slow") == 0  # the alert's condition
        assert value(samples, "ptc_jobs", status="running") >= 1
        assert value(samples, "ptc_jobs_oldest_age_seconds", status="running") > 0
        assert value(samples, "ptc_reservations_held") >= 1
        assert value(samples, "ptc_reservations_held_credits") >= 2
    finally:
        assert api.post(f"/api/v1/exec/{job['id']}/cancel").status_code == 200
    # The call ended with its job: recorded as never run, and what was held for it given back.
    deadline = time.monotonic() + 15
    while not (ended := ToolCall.objects.filter(exec_job_id=job["id"], status="failed").first()):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert ended.error["code"] == "job_ended"
    # The release follows the record's commit, as for any call that fails (tool_call_finish).
    while (held := Reservation.objects.get(tool_call_id=ended.call_id)).status == "held" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert held.status == "released"


def test_event_lag_is_observed_for_live_followers(stack: Stack, api: Api) -> None:
    before = value(scrape(stack), "ptc_event_lag_seconds_count")
    marker = uuid.uuid4().hex
    job = api.run(f"import time\ntime.sleep(1)\nprint('a')\ntime.sleep(0.5)\nprint('{marker}')", wait=0)
    with api.http.stream("GET", f"/api/v1/exec/{job['id']}/events", timeout=30) as response:
        for line in response.iter_lines():
            if line.startswith("event: exec_end"):
                break
    assert value(scrape(stack), "ptc_event_lag_seconds_count") > before


def test_a_managed_containers_job_is_not_a_job_stuck_running(stack: Stack, api: Api) -> None:
    """A managed container's job stays running for as long as its container may call back, with no
    worker: the fleet's gauges leave it out, or PtcJobsStuckRunning would fire for good."""
    container = f"container_{uuid.uuid4().hex[:12]}"
    caller = {"type": "code_execution_20260120", "tool_id": "srvtoolu_1"}
    body = {"toolset": "demo", "tool": "echo", "arguments": {"value": 1}, "caller": caller, "container_id": container}
    assert api.post("/api/v1/tools/execute", json=body).status_code == 200
    job = ExecJob.objects.get(container_id=container)
    ExecJob.objects.filter(pk=job.pk).update(started_at=timezone.now() - timedelta(hours=2))
    assert value(scrape(stack), "ptc_jobs_oldest_age_seconds", status="running") < 3600


# One step of a process that counts finished jobs: count, say so in a file, wait for the other's file.
_COUNTING = """
import sys, time
from pathlib import Path
from ptcproject import metrics
folder = Path(sys.argv[1])
for step in sys.argv[2:]:
    if step.startswith("wait:"):
        while not (folder / step[5:]).exists():
            time.sleep(0.02)
    elif step.startswith("say:"):
        (folder / step[4:]).touch()
    else:
        metrics.job_finished_observe(status="completed", toolsets=["demo"], seconds=1.0, spawn_ms=5.0)
"""


def test_processes_of_equal_pids_in_one_metrics_folder_are_all_counted(tmp_path: Path) -> None:
    """deploy/compose.yaml shares one PROMETHEUS_MULTIPROC_DIR between its containers, and each
    container's process is pid 1: prometheus_client named each process's file by its pid, so the web,
    exec, tools and beat wrote one file over each other, and /metrics lost what they counted."""
    folder, signals = tmp_path / "metrics", tmp_path / "signals"
    folder.mkdir()
    signals.mkdir()
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(folder)}

    def container(name: str) -> list[str]:
        """A process as a container's first: pid 1 in a PID namespace of its own, named ``name``."""
        return [
            "unshare",
            "--pid",
            "--uts",
            "--fork",
            "sh",
            "-c",
            'hostname "$0" && exec "$@"',
            name,
            sys.executable,
            "-c",
            _COUNTING,
            str(signals),
        ]

    first = subprocess.Popen([*container("web"), "count", "say:a", "wait:b", "count"], cwd=ROOT, env=env)
    second = subprocess.Popen([*container("exec"), "wait:a", "count", "say:b"], cwd=ROOT, env=env)
    assert second.wait(60) == 0 and first.wait(60) == 0, "unshare --pid needs root (make test runs as root)"
    events = CollectorRegistry()
    multiprocess.MultiProcessCollector(events, path=str(folder))
    assert events.get_sample_value("ptc_jobs_finished_total", {"status": "completed"}) == 3
    assert events.get_sample_value("ptc_sandbox_start_seconds_count") == 3
    # A container restarted takes up its files again: no new ones at each start, nothing lost.
    before = sorted(path.name for path in folder.iterdir())
    assert subprocess.run([*container("exec"), "count"], cwd=ROOT, env=env, timeout=60).returncode == 0
    assert sorted(path.name for path in folder.iterdir()) == before
    events = CollectorRegistry()
    multiprocess.MultiProcessCollector(events, path=str(folder))
    assert events.get_sample_value("ptc_jobs_finished_total", {"status": "completed"}) == 4


def test_jobs_ended_without_their_worker_are_counted(stack: Stack, api: Api) -> None:
    """A job whose worker died (failed by the reaper, or closed by it once cancelled), cancelled
    while queued, or a managed container's, cancelled, never reached an exec worker's end, which
    alone counted: PtcJobsFailing stayed quiet while workers died."""
    user = get_user_model().objects.get(username=api.username)
    before = scrape(stack)
    lost = running_job(
        user=user, started_at=timezone.now() - timedelta(minutes=5), heartbeat_at=timezone.now() - timedelta(minutes=5)
    )
    queued = ExecJob.objects.create(user=user, code="1", toolsets=[], timeout_seconds=10)
    assert api.post(f"/api/v1/exec/{queued.pk}/cancel").status_code == 200
    # A managed container's job, cancelled: no worker ever closes it.
    container = running_job(user=user, container_id=f"container_{uuid.uuid4().hex[:8]}", started_at=timezone.now())
    assert api.post(f"/api/v1/exec/{container.pk}/cancel").status_code == 200
    # Cancelled as it ran, and its worker died before it closed it: the reaper closes it.
    long_ago = timezone.now() - timedelta(hours=1)
    left = running_job(
        user=user, status="cancelled", started_at=long_ago, heartbeat_at=long_ago, finished_at=long_ago, closed_at=None
    )
    deadline = time.monotonic() + 15
    # The stack's reaper, every second.
    while ExecJob.objects.get(pk=lost.pk).status != "failed" or ExecJob.objects.get(pk=left.pk).closed_at is None:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    after = scrape(stack)
    counted = "ptc_jobs_finished_total"
    assert value(after, counted, status="failed") > value(before, counted, status="failed")
    assert value(after, counted, status="cancelled") >= value(before, counted, status="cancelled") + 3


def test_a_queue_a_toolset_names_that_no_setting_lists_is_reported(stack: Stack, make_api: Callable[..., Api]) -> None:
    """A queue dropped from PTC_TOOLS_QUEUES while a toolset still sends its calls there: they wait
    on it, no worker takes them, and /metrics listed only the configured queues, so no alert fired."""
    from tools.models import Toolset

    key = unique_key("gone")
    made = make_api(staff=True).post(
        "/api/v1/toolsets",
        json={"key": key, "name": "Gone", "kind": "http", "config": {"base_url": "http://127.0.0.1:9"}, "tools": []},
    )
    assert made.status_code == 201, made.text
    Toolset.objects.filter(key=key).update(queue="tools.gone")  # as the setting was changed under it
    try:
        samples = scrape(stack)
        assert ("ptc_queue_depth", (("queue", "tools.gone"),)) in samples
        assert value(samples, "ptc_queue_workers", queue="tools.gone") == 0
        assert ("ptc_queue_workers", (("queue", "tools.slow"),)) in samples  # the configured ones, as before
    finally:
        Toolset.objects.filter(key=key).delete()


def test_the_embedded_broker_is_not_said_up(settings: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the embedded default nothing of the broker is read (its queues are files): its
    ptc_fleet_up said 1 all the same."""
    from execution import backplane as plane_module
    from ptcproject.metrics import metrics_text

    settings.CELERY_BROKER_URL = "filesystem://"
    monkeypatch.setattr(plane_module, "backplane", plane_module.LocalBackplane)
    text = metrics_text().decode()
    assert 'ptc_fleet_up{source="database"} 1.0' in text
    assert 'source="broker"' not in text
    assert "ptc_queue_depth{" not in text
