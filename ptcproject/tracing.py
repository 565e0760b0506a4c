"""OpenTelemetry traces (README, "Traces"): one span per job, one child span per tool call.

Exported over OTLP/HTTP (protobuf) when ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set (the exporter reads it
and the other standard ``OTEL_*`` variables itself); otherwise nothing is built.

The spans are made from the records when the job has ended, on the exec worker that ran it, with
the records' own start and end times: no trace context travels in the broker's messages, nothing is
added to a tool call's path, and a call that was refused or never ran has its span like the others.
Tool-call spans follow the GenAI semantic conventions (``execute_tool``, ``gen_ai.tool.name``,
``gen_ai.tool.call.id``, ``error.type``); tool inputs and outputs are never put in a span.
"""

import functools
import logging
import os
from datetime import datetime
from typing import Any

from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as gen_ai
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer, set_span_in_context

logger = logging.getLogger("ptc.tracing")


@functools.cache
def tracer() -> Tracer | None:
    """This process's tracer, or None when no OTLP endpoint is configured. Built once; its batch
    processor exports from its own thread and flushes when the process exits."""
    if not os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip():  # blank is unset, as settings read it
        return None
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    # OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES name the service; without them, "ptc".
    resource = Resource.create()
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": "ptc"}))
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    return provider.get_tracer("ptcproject")


def _ns(at: datetime) -> int:
    return int(at.timestamp() * 1_000_000_000)


def job_trace_export(*, job: Any) -> None:
    """Emit ``job``'s span and its tool calls' child spans (a finished ExecJob; its calls are read
    in one query). Does nothing without an endpoint; never raises into the job's path."""
    trace = tracer()
    if trace is None or job.started_at is None or job.finished_at is None:
        return
    try:
        _job_trace(trace, job)
    except Exception:  # a trace must never fail a job
        logger.warning("could not build a job's trace", extra={"job_id": str(job.pk)}, exc_info=True)


def _job_trace(trace: Tracer, job: Any) -> None:
    from execution.models import ExecJob

    attributes = {
        "ptc.job.id": str(job.pk),
        "ptc.job.call_id": job.call_id,
        "ptc.job.status": job.status,
        "ptc.job.toolsets": list(job.toolsets),
        "ptc.job.sequential": job.sequential,
        "enduser.id": str(job.user_id),
        **{f"ptc.job.timings.{name}": float(ms) for name, ms in (job.timings or {}).items() if isinstance(ms, int | float)},
    }
    span = trace.start_span(
        f"ptc.exec {job.title or job.call_id}", kind=SpanKind.INTERNAL, attributes=attributes, start_time=_ns(job.started_at)
    )
    if job.status != ExecJob.Status.COMPLETED:
        error = job.error or {}
        span.set_attribute("error.type", str(error.get("type") or job.status))
        span.set_status(Status(StatusCode.ERROR, str(error.get("message", ""))[:500]))
    parent = set_span_in_context(span)
    for call in job.tool_calls.order_by("started_at", "id").only(
        "call_id", "toolset_key", "tool_name", "status", "error", "credits", "started_at", "finished_at"
    ):
        _call_span(trace, call, parent, end=call.finished_at or job.finished_at)
    span.end(end_time=_ns(job.finished_at))


def _call_span(trace: Tracer, call: Any, parent: Any, *, end: datetime) -> Span:
    attributes = {
        gen_ai.GEN_AI_OPERATION_NAME: gen_ai.GenAiOperationNameValues.EXECUTE_TOOL.value,
        gen_ai.GEN_AI_TOOL_NAME: call.tool_name,
        gen_ai.GEN_AI_TOOL_CALL_ID: call.call_id,
        gen_ai.GEN_AI_TOOL_TYPE: "function",
        "ptc.toolset": call.toolset_key,
        "ptc.tool_call.status": call.status,
        "ptc.tool_call.credits": call.credits,
    }
    span = trace.start_span(
        f"execute_tool {call.tool_name}",
        context=parent,
        kind=SpanKind.INTERNAL,
        attributes=attributes,
        start_time=_ns(call.started_at),
    )
    if call.status != "completed":
        code = (call.error or {}).get("code") or call.status
        span.set_attribute("error.type", str(code))
        span.set_status(Status(StatusCode.ERROR, str((call.error or {}).get("message", ""))[:500]))
    span.end(end_time=_ns(end))
    return span
