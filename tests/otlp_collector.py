"""A tiny OTLP/HTTP collector on loopback: takes ``POST /v1/traces`` (protobuf, as the OTLP exporter
sends), decodes each ExportTraceServiceRequest with the OpenTelemetry protos, and keeps the spans."""

import gzip
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest, ExportTraceServiceResponse
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        if self.path != "/v1/traces" or self.headers.get("Content-Type") != "application/x-protobuf":
            self.send_response(404)
            self.end_headers()
            return
        request = ExportTraceServiceRequest.FromString(body)
        collector: OtlpCollector = self.server.collector  # type: ignore[attr-defined]
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    collector.add(
                        {
                            "name": span.name,
                            "trace_id": span.trace_id.hex(),
                            "span_id": span.span_id.hex(),
                            "parent_span_id": span.parent_span_id.hex(),
                            "start_ns": span.start_time_unix_nano,
                            "end_ns": span.end_time_unix_nano,
                            "status_code": span.status.code,
                            "attributes": {a.key: _value(a.value) for a in span.attributes},
                            "resource": resource,
                        }
                    )
        reply = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)


class OtlpCollector:
    def __init__(self) -> None:
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.server.daemon_threads = True
        self.server.collector = self  # type: ignore[attr-defined]
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.spans: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def add(self, span: dict[str, Any]) -> None:
        with self.lock:
            self.spans.append(span)

    def __enter__(self) -> "OtlpCollector":
        self.thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self.server.shutdown()
        self.server.server_close()
