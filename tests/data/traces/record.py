"""Records the traces `tests/unit/test_explain.py` explains, from a real system.

    source .venv/bin/activate && python tests/data/traces/record.py [--out tests/data/traces]

Starts Redis, kvbroker, router, gateway, 2 prefill and 1 decode workers of the default small model
(float32, CPU) with every service exporting spans to an in-process OTLP receiver, provokes each
bottleneck for real, and writes each request's whole trace as an OTLP/JSON export
(`<case>.otlp.json`; resourceSpans -> scopeSpans -> spans) plus one in Jaeger's /api/traces shape:

  healthy         one short prompt on an idle system (through the gateway)
  prefill_queue   a burst of long prompts at once; prefill workers batch at most 256 tokens per forward,
                  so the last prompts wait behind the others (the one that waited longest is kept)
  slow_transfer   decode paused while the prompt is prefilled; once the first token is out the prefill
                  worker holding the KV is paused (SIGSTOP) for STALL_S, so decode's KV pull waits for it
  decode_tpot     a burst of concurrent requests decoding together on the one decode worker (the one with
                  the slowest time per output token is kept)
  migrated        as slow_transfer, but stalled past decode's transfer timeout: the pull fails (DATA_LOSS),
                  the router prefills again on the other prefill worker and decodes there (a `retry` span)
  invalid         a prompt longer than the model's context: refused (an error span status)

With --colocated it records one more case instead, on a system of one colocated worker:

  colocated       one short prompt prefilled and decoded by the same worker (through the gateway)

Nothing is edited afterwards: durations are what the run measured, so they vary from run to run.
Tests that need a stage slower than a run gave scale it themselves, in the test, by name.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import signal
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import grpc
from google.protobuf import json_format

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from distserve.engine.default_model import ensure_default_model  # noqa: E402
from distserve.launcher import Cluster, ClusterSpec  # noqa: E402
from distserve.v1 import common_pb2, router_pb2, router_pb2_grpc  # noqa: E402
from tests.cluster_helpers import wait_for_workers  # noqa: E402
from tests.otlp_receiver import OtlpReceiver  # noqa: E402

TRANSFER_TIMEOUT_S = 2.0
STALL_S = 0.8  # slow_transfer: well under the transfer timeout
LONG_PROMPT = " ".join(f"word{i}" for i in range(700))  # ~1,400 tokens


class RecordingReceiver(OtlpReceiver):
    """Keeps every export request as received, besides the parsed spans."""

    def __init__(self) -> None:
        super().__init__()
        self.requests = []

    def Export(self, request, context):
        with self._lock:
            self.requests.append(request)
        return super().Export(request, context)

    def otlp_json(self, request_id: str) -> dict:
        """The spans of the request's trace(s), as an OTLP/JSON export (ids in hex, enums as numbers)."""
        trace_ids = {s.trace_id for s in self.spans_for(request_id)}
        resource_spans = []
        with self._lock:
            for request in self.requests:
                for resource in json_format.MessageToDict(request, use_integers_for_enums=True)["resourceSpans"]:
                    for scope in resource.get("scopeSpans", []):
                        scope["spans"] = [_hex_ids(s) for s in scope.get("spans", [])]
                        scope["spans"] = [s for s in scope["spans"] if s["traceId"] in trace_ids]
                    resource["scopeSpans"] = [s for s in resource.get("scopeSpans", []) if s["spans"]]
                    if resource["scopeSpans"]:
                        resource_spans.append(resource)
        return {"resourceSpans": resource_spans}


def _hex_ids(span: dict) -> dict:
    for key in ("traceId", "spanId", "parentSpanId"):
        if span.get(key):
            span[key] = base64.b64decode(span[key]).hex()
    return span


def jaeger_json(otlp: dict) -> dict:
    """The same spans as Jaeger's query API returns them (typed tags; status as otel.status_* and error)."""
    processes, spans = {}, []
    for resource in otlp["resourceSpans"]:
        service = next(a["value"]["stringValue"] for a in resource["resource"]["attributes"]
                       if a["key"] == "service.name")
        pid = processes.setdefault(service, f"p{len(processes) + 1}")
        for scope in resource["scopeSpans"]:
            for span in scope["spans"]:
                tags = [_jaeger_tag(a["key"], a["value"]) for a in span.get("attributes", [])]
                status = span.get("status", {})
                if status.get("code") == 2:
                    tags += [{"key": "otel.status_code", "type": "string", "value": "ERROR"},
                             {"key": "error", "type": "bool", "value": True}]
                    if status.get("message"):
                        tags.append({"key": "otel.status_description", "type": "string", "value": status["message"]})
                start_ns, end_ns = int(span["startTimeUnixNano"]), int(span["endTimeUnixNano"])
                spans.append({"traceID": span["traceId"], "spanID": span["spanId"], "operationName": span["name"],
                              "references": [{"refType": "CHILD_OF", "traceID": span["traceId"],
                                              "spanID": span["parentSpanId"]}] if span.get("parentSpanId") else [],
                              "startTime": start_ns // 1000, "duration": (end_ns - start_ns) // 1000,
                              "processID": pid, "tags": tags})
    return {"data": [{"traceID": spans[0]["traceID"], "spans": spans,
                      "processes": {p: {"serviceName": s, "tags": []} for s, p in processes.items()}}],
            "total": 0, "limit": 0, "offset": 0, "errors": None}


def _jaeger_tag(key: str, value: dict) -> dict:
    kind, raw = next(iter(value.items()))
    if kind == "intValue":
        return {"key": key, "type": "int64", "value": int(raw)}
    if kind == "doubleValue":
        return {"key": key, "type": "float64", "value": raw}
    if kind == "boolValue":
        return {"key": key, "type": "bool", "value": raw}
    if kind == "arrayValue":  # Jaeger stores arrays as their JSON text
        items = [next(iter(v.values())) for v in raw.get("values", [])]
        return {"key": key, "type": "string", "value": json.dumps(items)}
    return {"key": key, "type": "string", "value": raw}


def via_gateway(cluster, request_id: str, prompt: str, max_tokens: int) -> None:
    with urllib.request.urlopen(cluster.gateway_url + "/v1/models", timeout=10) as reply:
        model = json.load(reply)["data"][0]["id"]
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True}).encode()
    request = urllib.request.Request(cluster.gateway_url + "/v1/completions", body, method="POST", headers={
        "Content-Type": "application/json", "X-Request-Id": request_id})
    with urllib.request.urlopen(request, timeout=120) as reply:
        reply.read()


class Stream:
    """A Generate call to the router, read on a thread; `first_token` is set at its first message."""

    def __init__(self, channel, request_id: str, prompt: str, max_tokens: int):
        self.first_token = threading.Event()
        self.worker = ""
        self.error = None
        sampling = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        self._call = router_pb2_grpc.RouterServiceStub(channel).Generate(
            router_pb2.GenerateRequest(request_id=request_id, text=prompt, sampling=sampling), timeout=120)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for message in self._call:
                if not self.first_token.is_set():
                    self.worker = message.prefill_worker
                    self.first_token.set()
        except grpc.RpcError as exc:
            self.error = exc
        finally:
            self.first_token.set()

    def join(self) -> None:
        self._thread.join(120)


def pid_of(cluster, worker_id: str) -> int:
    """The pid of the worker registered as worker_id (role-host-port)."""
    port = worker_id.rsplit("-", 1)[-1]
    return next(p.popen.pid for p in cluster.processes.values() if p.address and p.address.endswith(f":{port}"))


def stalled_after_first_token(cluster, request_id: str, stall_s: float) -> None:
    """Decode paused during prefill; then the KV's owner paused for stall_s while decode pulls from it."""
    decode_pids = [p.popen.pid for name, p in cluster.processes.items() if name.startswith("decode")]
    channel = grpc.insecure_channel(cluster.router_address)
    for pid in decode_pids:
        os.kill(pid, signal.SIGSTOP)
    stalled = 0
    try:
        stream = Stream(channel, request_id, "The quick brown fox jumps over the lazy dog", 8)
        stream.first_token.wait(30)
        stalled = pid_of(cluster, stream.worker)
        os.kill(stalled, signal.SIGSTOP)
    finally:
        for pid in decode_pids:
            os.kill(pid, signal.SIGCONT)
    try:
        time.sleep(stall_s)
    finally:
        os.kill(stalled, signal.SIGCONT)
    stream.join()


def burst(cluster, prefix: str, count: int, prompt: str, max_tokens: int) -> list[str]:
    ids = [f"{prefix}-{i}" for i in range(count)]
    threads = [threading.Thread(target=via_gateway, args=(cluster, rid, prompt, max_tokens)) for rid in ids]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    time.sleep(1.5)  # their last spans are exported (batch delay 100 ms)
    return ids


def stage_s(receiver, request_id: str, service: str, name: str) -> float:
    return sum((s.end_ns - s.start_ns) / 1e9 for s in receiver.spans_for(request_id)
               if s.name == name and s.service == service)


def tpot_s(receiver, request_id: str) -> float:
    spans = receiver.spans_for(request_id)
    root = next((s for s in spans if s.name == "router.generate"), None)
    first = min((s.end_ns for s in spans if s.name == "prefill"), default=None)
    if root is None or first is None:
        return 0.0
    return (root.end_ns - first) / 1e9 / max(root.attributes.get("gen_ai.usage.output_tokens", 2) - 1, 1)


def record(cluster, receiver) -> dict[str, str]:
    """Provokes every case; returns case -> the request id kept for it."""
    via_gateway(cluster, "warmup", "Hello", 4)
    kept = {"healthy": "explain-healthy"}
    via_gateway(cluster, "explain-healthy", "Once upon a time", 16)
    queued = burst(cluster, "explain-queue", 8, LONG_PROMPT, 4)
    kept["prefill_queue"] = max(queued, key=lambda r: stage_s(receiver, r, "distserve-prefill", "queue"))
    kept["slow_transfer"] = "explain-transfer"
    stalled_after_first_token(cluster, "explain-transfer", STALL_S)
    decoding = burst(cluster, "explain-decode", 16, "Serving systems", 64)
    kept["decode_tpot"] = max(decoding, key=lambda r: tpot_s(receiver, r))
    kept["migrated"] = "explain-migrated"
    stalled_after_first_token(cluster, "explain-migrated", TRANSFER_TIMEOUT_S + 1.5)
    kept["invalid"] = "explain-invalid"
    stream = Stream(grpc.insecure_channel(cluster.router_address), "explain-invalid", "word " * 5000, 4)
    stream.join()
    return kept


def record_colocated(cluster, receiver) -> dict[str, str]:
    via_gateway(cluster, "warmup", "Hello", 4)
    via_gateway(cluster, "explain-colocated", "Once upon a time", 16)
    return {"colocated": "explain-colocated"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    parser.add_argument("--colocated", action="store_true", help="record only the colocated case")
    args = parser.parse_args()
    receiver = RecordingReceiver().start()
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_EXPORTER_OTLP_INSECURE": "true",
           "OTEL_BSP_SCHEDULE_DELAY": "100", "DISTSERVE_DTYPE": "float32"}
    workers = {"num_prefill": 0, "num_decode": 0, "num_colocated": 1} if args.colocated else {
        "num_prefill": 2, "num_decode": 1}
    spec = ClusterSpec(model=str(ensure_default_model("small")), **workers, gateway_port=0,
                       router_port=0, broker_port=0, prefill_base_port=0, decode_base_port=0, colocated_base_port=0,
                       redis_port=0, metrics_base_port=0, share_cores=True, env=env,
                       log_dir=tempfile.mkdtemp(prefix="explain-logs-"),
                       prefill_args=["--max-batch-tokens", "256", "--heartbeat-s", "0.5"],
                       decode_args=["--kv-cache-mb", "512", "--transfer-timeout-s", str(TRANSFER_TIMEOUT_S)])
    cases = args.out / "cases.json"
    try:
        cluster = Cluster(spec).start()
        try:
            wait_for_workers(cluster, spec.num_prefill, spec.num_decode, num_colocated=spec.num_colocated)
            kept = (record_colocated if args.colocated else record)(cluster, receiver)
            time.sleep(2)  # the last spans are exported (batch delay 100 ms)
        finally:
            cluster.stop()
        for case, request_id in kept.items():
            document = receiver.otlp_json(request_id)
            (args.out / f"{case}.otlp.json").write_text(json.dumps(document, indent=1) + "\n")
            num_spans = sum(len(s["spans"]) for r in document["resourceSpans"] for s in r["scopeSpans"])
            print(f"{case}: request id {request_id}, {num_spans} spans", flush=True)
        if args.colocated:
            kept = {**json.loads(cases.read_text()), **kept}
        else:
            jaeger = jaeger_json(receiver.otlp_json(kept["prefill_queue"]))
            (args.out / "prefill_queue.jaeger.json").write_text(json.dumps(jaeger, indent=1) + "\n")
        cases.write_text(json.dumps(kept, indent=1) + "\n")
    finally:
        receiver.stop()


if __name__ == "__main__":
    main()
