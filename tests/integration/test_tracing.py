"""One trace per request across every service, exported over OTLP/gRPC to the test's receiver."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

from distserve.model_spec import load_model_spec

PROMPT_LEN = 300
# (service, span) -> expected parent (service, span); None for the root
EXPECTED_TREE = {
    ("distserve-gateway", "gateway.http"): None,
    ("distserve-router", "router.generate"): ("distserve-gateway", "gateway.http"),
    ("distserve-router", "route"): ("distserve-router", "router.generate"),
    ("distserve-router", "first_token_sent"): ("distserve-router", "router.generate"),
    ("distserve-prefill", "prefill"): ("distserve-router", "router.generate"),
    ("distserve-prefill", "queue"): ("distserve-prefill", "prefill"),
    ("distserve-prefill", "forward"): ("distserve-prefill", "prefill"),
    ("distserve-prefill", "first_token"): ("distserve-prefill", "prefill"),
    ("distserve-kvbroker", "register"): ("distserve-prefill", "prefill"),
    ("distserve-decode", "decode"): ("distserve-router", "router.generate"),
    ("distserve-decode", "kv_load"): ("distserve-decode", "decode"),
    ("distserve-kvbroker", "claim"): ("distserve-decode", "kv_load"),
    ("distserve-decode", "kv_transfer.recv"): ("distserve-decode", "kv_load"),
    ("distserve-prefill", "kv_transfer.send"): ("distserve-decode", "kv_transfer.recv"),
    ("distserve-kvbroker", "release"): ("distserve-decode", "decode"),
    ("distserve-decode", "queue"): ("distserve-decode", "decode"),
    ("distserve-decode", "generate"): ("distserve-decode", "decode"),
    ("distserve-decode", "stream"): ("distserve-decode", "decode"),
}
CLOCK_SLACK_NS = 2_000_000  # stage spans measured in threads are converted from the monotonic clock


def collect(receiver, request_id: str, expected: int, timeout_s: float = 15):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        spans = receiver.spans_for(request_id)
        if len(spans) >= expected:
            time.sleep(0.5)  # anything late would show up now
            return receiver.spans_for(request_id)
        time.sleep(0.1)
    return receiver.spans_for(request_id)


def send_through_gateway(cluster, request_id: str, prompt: list[int], max_tokens: int) -> dict:
    body = json.dumps({"model": Path(cluster.spec.model).name, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True}).encode()
    http = urllib.request.Request(cluster.gateway_url + "/v1/completions", data=body, method="POST",
                                  headers={"Content-Type": "application/json", "X-Request-Id": request_id})
    with urllib.request.urlopen(http, timeout=120) as reply:
        assert reply.headers["X-Request-Id"] == request_id
        return json.load(reply)


def test_one_trace_spans_every_stage(cluster, otlp_receiver, tiny_model_path):
    request_id = "trace-one-request"
    send_through_gateway(cluster, request_id, list(range(40, 40 + PROMPT_LEN)), 6)
    spans = collect(otlp_receiver, request_id, len(EXPECTED_TREE))

    assert len({s.trace_id for s in spans}) == 1, "one trace id for the whole request"
    with otlp_receiver._lock:
        in_trace = [s for s in otlp_receiver.spans if s.trace_id == spans[0].trace_id]
    assert all(s.attributes.get("gen_ai.request.id") == request_id for s in in_trace), "request id on every span"
    by_key = {(s.service, s.name): s for s in spans}
    assert set(by_key) == set(EXPECTED_TREE), sorted(set(by_key) ^ set(EXPECTED_TREE))
    by_id = {s.span_id: s for s in spans}
    for key, parent_key in EXPECTED_TREE.items():
        span = by_key[key]
        if parent_key is None:
            assert not span.parent_id
            continue
        parent = by_id.get(span.parent_id)
        assert parent is not None and (parent.service, parent.name) == parent_key, (key, parent)
        assert span.start_ns >= parent.start_ns - CLOCK_SLACK_NS, (key, "starts before its parent")
        assert span.end_ns <= parent.end_ns + CLOCK_SLACK_NS, (key, "ends after its parent")

    # the router sends the first token on once sampled, before the prefill call (KV registration) ends
    sent = by_key[("distserve-router", "first_token_sent")]
    assert by_key[("distserve-prefill", "first_token")].end_ns - CLOCK_SLACK_NS <= sent.start_ns
    assert sent.start_ns <= by_key[("distserve-prefill", "prefill")].end_ns + CLOCK_SLACK_NS

    spec = load_model_spec(tiny_model_path)
    handle_bytes = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * PROMPT_LEN * 4
    for side in ("kv_transfer.send", "kv_transfer.recv"):
        attrs = next(s for s in spans if s.name == side).attributes
        assert attrs["distserve.kv.bytes"] == handle_bytes
        assert attrs["distserve.kv.transfer_gbps"] > 0 and attrs["network.transport"] == "ucx"
    gateway = by_key[("distserve-gateway", "gateway.http")].attributes
    assert gateway["http.response.status_code"] == 200 and gateway["gen_ai.request.max_tokens"] == 6
    root = by_key[("distserve-router", "router.generate")].attributes
    assert root["gen_ai.request.max_tokens"] == 6 and root["gen_ai.usage.input_tokens"] == PROMPT_LEN
    assert root["gen_ai.usage.output_tokens"] == 6 and root["gen_ai.response.finish_reasons"] == ["length"]
    assert root["gen_ai.operation.name"] == "text_completion" and root["gen_ai.request.model"]


def test_distserve_trace_prints_waterfall_from_jaeger_api(cluster, otlp_receiver, capsys):
    import json
    import urllib.parse

    from distserve.cli import main
    from tests.fake_jaeger import fake_jaeger
    from tests.otlp_receiver import as_jaeger_trace

    request_id = "trace-cli-request"
    send_through_gateway(cluster, request_id, list(range(70, 90)), 3)
    spans = collect(otlp_receiver, request_id, len(EXPECTED_TREE))
    with fake_jaeger(json.dumps(as_jaeger_trace(spans)).encode()) as (url, paths):
        assert main(["trace", request_id, "--jaeger", url]) == 0
    out = capsys.readouterr().out
    query = urllib.parse.urlparse(paths[0])
    path, params = query.path, urllib.parse.parse_qs(query.query)
    assert path == "/api/traces" and params["service"] == ["distserve-router"]
    assert json.loads(params["tags"][0]) == {"gen_ai.request.id": request_id}
    lines = out.splitlines()
    assert lines[0].startswith(f"trace: {len(spans)} spans")
    assert lines[1].startswith("gateway.http") and "distserve-gateway" in lines[1]
    for (service, name), parent in EXPECTED_TREE.items():
        line = next(ln for ln in lines[1:] if ln.split()[0] == name and service in ln)
        depth = (len(line) - len(line.lstrip(" "))) // 2
        assert (depth == 0) == (parent is None)
        assert " ms  |" in line


def test_stage_logs_carry_request_and_trace_ids(cluster, otlp_receiver):
    request_id = "trace-logs-request"
    send_through_gateway(cluster, request_id, list(range(200, 240)), 4)
    trace_id = collect(otlp_receiver, request_id, len(EXPECTED_TREE))[0].trace_id
    for role in ("router", "prefill", "decode", "kvbroker"):
        lines = [ln for name, process in cluster.processes.items() if name.startswith(role)
                 for ln in process.log_path.read_text().splitlines() if f"request_id={request_id}" in ln]
        assert lines, f"no {role} logged a stage of {request_id}"
        assert all(ln.endswith(f"trace_id={trace_id}") and " INFO " in ln for ln in lines), lines


def test_failed_request_span_records_the_error(cluster, otlp_receiver):
    import grpc

    from tests.builders import generate, token_request

    request = token_request([5, 6, 7], temperature=-1.0)
    request.request_id = "trace-bad-request"
    try:
        generate(cluster.router_address, request)
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT
    else:
        raise AssertionError("a negative temperature must be rejected")
    root = next(s for s in collect(otlp_receiver, request.request_id, 1) if s.name == "router.generate")
    assert root.status_code == 2  # STATUS_CODE_ERROR
    assert "exception" in root.events
