"""Traces on the real stack: a deployment with OTEL_EXPORTER_OTLP_ENDPOINT sends one span per job,
with a child span per tool call (GenAI conventions), to a local OTLP/HTTP collector."""

import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import Api, own_deployment
from tests.otlp_collector import OtlpCollector
from tests.servers import api_key
from tests.stack import Stack, free_port


@pytest.fixture(scope="module")
def collector() -> Iterator[OtlpCollector]:
    with OtlpCollector() as running:
        yield running


@pytest.fixture(scope="module")
def traced(stack_env: dict[str, str], collector: OtlpCollector) -> Iterator[Stack]:
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": collector.url,
        "OTEL_SERVICE_NAME": "ptc-test",
        "OTEL_BSP_SCHEDULE_DELAY": "100",  # export within 0.1 s, not the default 5 s
        "PTC_DB_POOL_MIN": "1",  # PostgreSQL's connections are shared by every process of the run
    }
    with own_deployment(stack_env, "traced", **env) as stack:
        yield stack


def _spans_of(collector: OtlpCollector, job_id: str, count: int) -> list[dict[str, Any]]:
    deadline = time.monotonic() + 20
    while True:
        with collector.lock:
            root = [s for s in collector.spans if s["attributes"].get("ptc.job.id") == job_id]
            trace = [s for s in collector.spans if root and s["trace_id"] == root[0]["trace_id"]]
        if len(trace) >= count:
            return trace
        assert time.monotonic() < deadline, f"{len(trace)} of {count} spans arrived"
        time.sleep(0.1)


def test_a_job_is_a_span_with_a_child_span_per_tool_call(traced: Stack, collector: OtlpCollector) -> None:
    username = f"traced-{free_port()}"
    api = Api(traced.base_url, api_key(traced.env, username), username)
    code = """
from ptc_tools import ToolError
from ptc_tools.demo import Demo
Demo.add(a=1, b=2)
try:
    Demo.fail(message="nope")
except ToolError:
    pass
"""
    job = api.run(code, toolsets=["demo"], title="traced job")
    assert job["status"] == "completed"
    spans = _spans_of(collector, job["id"], 3)
    root = next(s for s in spans if s["parent_span_id"] == "")
    assert root["name"] == "ptc.exec traced job"
    assert root["attributes"]["ptc.job.call_id"] == job["call_id"]
    assert root["attributes"]["ptc.job.status"] == "completed"
    assert root["resource"]["service.name"] == "ptc-test"
    assert root["status_code"] != 2  # not ERROR
    children = sorted((s for s in spans if s is not root), key=lambda s: s["start_ns"])
    assert [c["parent_span_id"] for c in children] == [root["span_id"]] * 2
    assert [c["name"] for c in children] == ["execute_tool add", "execute_tool fail"]
    calls = {c["call_id"]: c for c in job["tool_calls"]}
    for child in children:
        attributes = child["attributes"]
        assert attributes["gen_ai.operation.name"] == "execute_tool"
        assert attributes["gen_ai.tool.call.id"] in calls
        assert attributes["gen_ai.tool.name"] == calls[attributes["gen_ai.tool.call.id"]]["tool"]
        assert attributes["ptc.toolset"] == "demo"
        assert root["start_ns"] <= child["start_ns"] <= child["end_ns"] <= root["end_ns"]
    failed = children[1]
    assert failed["status_code"] == 2 and failed["attributes"]["error.type"] == "tool_failed"
    assert "nope" not in str(children[0]["attributes"]) and "a" not in children[0]["attributes"]  # no tool I/O

    broken = api.run("raise KeyError('x')")
    root = _spans_of(collector, broken["id"], 1)[0]
    assert root["status_code"] == 2 and root["attributes"]["error.type"] == "KeyError"


def test_a_blank_endpoint_builds_no_exporter(monkeypatch: pytest.MonkeyPatch) -> None:
    """Settings read a blank OTEL_EXPORTER_OTLP_ENDPOINT as unset and check nothing; the tracer took
    it for an endpoint, and its exporter failed at every job's end, in its own thread."""
    from ptcproject import tracing

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", " ")
    tracing.tracer.cache_clear()
    try:
        assert tracing.tracer() is None
    finally:
        tracing.tracer.cache_clear()
