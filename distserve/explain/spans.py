"""A request's spans, from an OTLP/JSON export file or from Jaeger's query API, as trace_view rows.

OTLP/JSON (what an OTLP exporter or collector writes) is
{"resourceSpans": [{"resource": {"attributes": [...]}, "scopeSpans": [{"spans": [{traceId, spanId,
parentSpanId, name, startTimeUnixNano, endTimeUnixNano, attributes: [{key, value: {stringValue |
intValue | doubleValue | boolValue | arrayValue}}], status: {code, message}}]}]}]}.
Either way the rows are those of the newest trace holding a span tagged with the request id.
"""

from __future__ import annotations

from distserve.trace_view import SpanRow, fetch_trace, rows_from_jaeger
from distserve.tracing import REQUEST_ID

STATUS_MESSAGE = "otel.status_description"  # Jaeger's tag for a span status message; OTLP's is put under it too
_STATUS_ERROR = (2, "STATUS_CODE_ERROR")


class TraceNotFound(LookupError):
    """No span in the source carries the request id."""


def rows_from_otlp(document: dict, request_id: str) -> list[SpanRow]:
    """The spans of the newest trace in an OTLP/JSON export that holds the request; TraceNotFound if none."""
    traces: dict[str, list[SpanRow]] = {}
    for resource in document.get("resourceSpans", []):
        service = _attributes(resource.get("resource", {}).get("attributes", [])).get("service.name", "?")
        for scope in resource.get("scopeSpans", []):
            for span in scope.get("spans", []):
                traces.setdefault(span["traceId"], []).append(_otlp_row(service, span))
    return _newest_with(list(traces.values()), request_id)


def rows_from_jaeger_query(jaeger_url: str, request_id: str, service: str = "distserve-router") -> list[SpanRow]:
    """The request's spans as Jaeger's query API returns them; OSError if Jaeger cannot be reached."""
    reply = fetch_trace(jaeger_url, service, request_id)
    return rows_from_jaeger_reply(reply, request_id)


def rows_from_jaeger_reply(reply: dict, request_id: str) -> list[SpanRow]:
    return _newest_with([rows_from_jaeger(trace) for trace in reply.get("data") or []], request_id)


def _newest_with(traces: list[list[SpanRow]], request_id: str) -> list[SpanRow]:
    matching = [rows for rows in traces if any(str(r.attributes.get(REQUEST_ID)) == request_id for r in rows)]
    if not matching:
        raise TraceNotFound(f"no trace found for request id {request_id}")
    return max(matching, key=lambda rows: min(r.start_us for r in rows))


def _otlp_row(service: str, span: dict) -> SpanRow:
    attributes = _attributes(span.get("attributes", []))
    status = span.get("status") or {}
    failed = status.get("code") in _STATUS_ERROR
    if failed and status.get("message"):
        attributes[STATUS_MESSAGE] = status["message"]
    start_ns, end_ns = int(span["startTimeUnixNano"]), int(span["endTimeUnixNano"])
    return SpanRow(span["spanId"], span.get("parentSpanId", ""), service, span["name"], start_ns // 1000,
                   max(end_ns - start_ns, 0) // 1000, failed, attributes)


def _attributes(pairs: list[dict]) -> dict:
    return {pair["key"]: _value(pair.get("value", {})) for pair in pairs}


def _value(value: dict):
    if "arrayValue" in value:
        return [_value(v) for v in value["arrayValue"].get("values", [])]
    if "intValue" in value:
        return int(value["intValue"])  # a string in OTLP/JSON (64-bit)
    for kind in ("stringValue", "doubleValue", "boolValue", "bytesValue"):
        if kind in value:
            return value[kind]
    return None
