"""What tracing costs per request: span overhead with no endpoint (API no-op) and with the SDK exporting.

    python -m benchmarks.tracing_overhead --out benchmarks/results/tracing_overhead.json

A request creates ~16 spans across services (see tests/integration/test_tracing.py).
This measures the per-span cost of distserve.tracing.span() in both modes, in one
process each, and reports the per-request cost next to a typical request latency.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from benchmarks.results_io import write_results

SPANS_PER_REQUEST = 16
_CHILD = r"""
import json, os, sys, time
from distserve import tracing
enabled = tracing.init_tracing("bench")
n = int(sys.argv[1])
for _ in range(1000):  # warm-up
    with tracing.span("warm", "r"):
        pass
start = time.perf_counter()
for i in range(n):
    with tracing.span("stage", "request-id", **{"distserve.kv.bytes": i}):
        pass
per_span = (time.perf_counter() - start) / n
tracing.shutdown_tracing()
print(json.dumps({"sdk_installed": enabled, "per_span_us": per_span * 1e6}))
"""


def run(env_extra: dict[str, str], n: int) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(env_extra)
    out = subprocess.run([sys.executable, "-c", _CHILD, str(n)], env=env, capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spans", type=int, default=50000)
    parser.add_argument("--out", default="benchmarks/results/tracing_overhead.json")
    args = parser.parse_args()
    off = run({}, args.spans)
    # An endpoint nobody listens on: spans are built, batched and dropped by the exporter thread.
    on = run({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", "OTEL_EXPORTER_OTLP_INSECURE": "true"}, args.spans)
    result = {
        "no_endpoint": {**off, "per_request_us": off["per_span_us"] * SPANS_PER_REQUEST},
        "sdk_exporting": {**on, "per_request_us": on["per_span_us"] * SPANS_PER_REQUEST},
        "spans_per_request": SPANS_PER_REQUEST,
        "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    write_results(args.out, result)


if __name__ == "__main__":
    main()
