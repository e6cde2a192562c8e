"""OpenTelemetry tracing: one trace per request across every service.

Configured only by the standard variables (OTEL_EXPORTER_OTLP_ENDPOINT or
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, OTEL_SERVICE_NAME, OTEL_TRACES_SAMPLER, ...).
With no endpoint, no SDK provider is installed and spans are the API's no-op
spans, so tracing costs nothing. W3C trace context crosses gRPC in metadata
(`traceparent`): clients inject it with `TracingClientInterceptor`s, servers
start their spans under `server_context(grpc_context)`.

Every span carries the request id as `gen_ai.request.id`.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any, Iterator

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace

REQUEST_ID = "gen_ai.request.id"
# The router's mark (a zero-length span) of the moment it sends a request's first token on; the
# prefill worker goes on to register the KV after it, so that is not part of time to first token.
FIRST_TOKEN_SENT = "first_token_sent"
_installed = False


def init_tracing(default_service_name: str) -> bool:
    """Installs the SDK with an OTLP/gRPC exporter when an endpoint is configured; returns whether it did."""
    global _installed
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if _installed or not endpoint or os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return _installed
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    name = os.environ.get("OTEL_SERVICE_NAME") or default_service_name
    provider = TracerProvider(resource=Resource.create({"service.name": name}))  # sampler from OTEL_TRACES_SAMPLER
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    _installed = True
    return True


def shutdown_tracing() -> None:
    """Flushes spans still buffered (call at service exit)."""
    provider = trace.get_tracer_provider()
    if hasattr(provider, "shutdown"):
        provider.shutdown()


def tracer() -> trace.Tracer:
    return trace.get_tracer("distserve")


_NO_SPAN = contextlib.nullcontext(trace.INVALID_SPAN)
_NO_CONTEXT = contextlib.nullcontext()


def span(name: str, request_id: str, **attributes: Any):
    """A span under the current context, tagged with the request id; exceptions are recorded.

    Without an installed SDK this returns a shared no-op context at once (tracing off costs ~nothing).
    """
    if not _installed:
        return _NO_SPAN
    attrs = {REQUEST_ID: request_id, **{k: v for k, v in attributes.items() if v is not None}}
    return tracer().start_as_current_span(name, attributes=attrs)


def record_span(name: str, request_id: str, start_ns: int, end_ns: int, **attributes: Any) -> None:
    """Records a finished stage (measured elsewhere, e.g. in a batch thread) under the current span."""
    if not _installed:
        return
    attrs = {REQUEST_ID: request_id, **{k: v for k, v in attributes.items() if v is not None}}
    tracer().start_span(name, start_time=start_ns, attributes=attrs).end(end_time=max(start_ns, end_ns))


def mark(name: str, request_id: str, **attributes: Any) -> None:
    """Records a zero-length span at this moment under the current span (an instant, e.g. FIRST_TOKEN_SENT)."""
    if not _installed:
        return
    now_ns = time.time_ns()
    record_span(name, request_id, now_ns, now_ns, **attributes)


def remote_context(headers: dict[str, str]):
    """Makes the trace context carried in headers (traceparent) current inside the block."""
    return _attached(headers) if _installed else _NO_CONTEXT


@contextlib.contextmanager
def _attached(headers: dict[str, str]) -> Iterator[None]:
    token = otel_context.attach(propagate.extract(headers))
    try:
        yield
    finally:
        otel_context.detach(token)


def server_context(grpc_context):
    """Makes the caller's trace context (from gRPC metadata) current for this handler."""
    if not _installed:
        return _NO_CONTEXT
    return remote_context({k: v for k, v in (grpc_context.invocation_metadata() or ()) if isinstance(v, str)})


def inject_headers(headers: dict[str, str]) -> dict[str, str]:
    """Adds W3C trace context (traceparent/tracestate) for the current span to headers."""
    if _installed:
        propagate.inject(headers)
    return headers


def wall_ns(monotonic_s: float) -> int:
    """Converts a time.monotonic() reading to wall-clock nanoseconds, for span timestamps."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


def current_span() -> trace.Span:
    return trace.get_current_span()


def current_trace_id() -> str:
    ctx = trace.get_current_span().get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else ""


def _with_trace_metadata(details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
    if not _installed:
        return details
    metadata = list(details.metadata or ())
    metadata.extend(inject_headers({}).items())
    return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                      details.wait_for_ready)


class _UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(_with_trace_metadata(client_call_details), request)


class _UnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(_with_trace_metadata(client_call_details), request)


def client_interceptors() -> list[grpc.aio.ClientInterceptor]:
    """Interceptors that carry the current trace context on every outgoing call; none while tracing is
    off (call init_tracing first). grpc.aio runs an intercepted call in an extra task and each of its
    stream reads through an extra async generator, on every hop of every token: not worth paying for
    nothing to carry."""
    return [_UnaryUnary(), _UnaryStream()] if _installed else []
