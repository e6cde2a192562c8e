"""An OTLP/gRPC trace receiver for tests: the protocol Jaeger ingests, collected in memory.

Also renders what it collected the way Jaeger's query API (`/api/traces`) returns it,
so `distserve trace` can be tested on real span data.
"""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from distserve.launcher import free_port


def _attr_value(value):
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_attr_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


class CollectedSpan:
    def __init__(self, service: str, span):
        self.service = service
        self.name = span.name
        self.trace_id = span.trace_id.hex()
        self.span_id = span.span_id.hex()
        self.parent_id = span.parent_span_id.hex()
        self.start_ns = span.start_time_unix_nano
        self.end_ns = span.end_time_unix_nano
        self.attributes = {a.key: _attr_value(a.value) for a in span.attributes}
        self.status_code = span.status.code
        self.events = [e.name for e in span.events]

    def __repr__(self) -> str:
        return f"<{self.service}:{self.name} {self.span_id} parent={self.parent_id}>"


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[CollectedSpan] = []
        self._lock = threading.Lock()
        self.port = free_port()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self._server.add_insecure_port(f"127.0.0.1:{self.port}")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "OtlpReceiver":
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop(0)

    def Export(self, request, context):
        collected = []
        for resource_spans in request.resource_spans:
            attrs = {a.key: _attr_value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                collected.extend(CollectedSpan(attrs.get("service.name", "?"), s) for s in scope_spans.spans)
        with self._lock:
            self.spans.extend(collected)
        return trace_service_pb2.ExportTraceServiceResponse()

    def spans_for(self, request_id: str) -> list[CollectedSpan]:
        with self._lock:
            return [s for s in self.spans if s.attributes.get("gen_ai.request.id") == request_id]

    def wait_for_span(self, request_id: str, name: str, timeout_s: float = 10) -> CollectedSpan:
        """The first span called `name` of a request, once exported; fails after timeout_s."""
        deadline = time.monotonic() + timeout_s
        while not (spans := [s for s in self.spans_for(request_id) if s.name == name]):
            assert time.monotonic() < deadline, f"span {name} of {request_id} never arrived"
            time.sleep(0.1)
        return spans[0]


def as_jaeger_trace(spans: list[CollectedSpan]) -> dict:
    """Spans of one trace in the JSON shape of Jaeger's /api/traces response."""
    services = sorted({s.service for s in spans})
    process_ids = {name: f"p{i + 1}" for i, name in enumerate(services)}
    return {"data": [{
        "traceID": spans[0].trace_id,
        "spans": [{
            "traceID": s.trace_id, "spanID": s.span_id, "operationName": s.name,
            "references": [{"refType": "CHILD_OF", "traceID": s.trace_id, "spanID": s.parent_id}]
            if s.parent_id else [],
            "startTime": s.start_ns // 1000, "duration": (s.end_ns - s.start_ns) // 1000,
            "processID": process_ids[s.service],
            "tags": [{"key": k, "type": "string", "value": str(v)} for k, v in s.attributes.items()],
        } for s in spans],
        "processes": {pid: {"serviceName": name, "tags": []} for name, pid in process_ids.items()},
    }], "total": 0, "limit": 0, "offset": 0, "errors": None}
