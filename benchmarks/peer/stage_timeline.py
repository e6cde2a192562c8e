"""Where a workload's requests spend their time, stage by stage, from their traces.

Starts `distserve up` (its defaults, or the flags after `--`) with every service exporting spans to an
in-process OTLP receiver, runs the peer-bench workload (../shared/peer-bench/bench.sh) at one rate,
and prints, per span name, how many traces have it, when it starts (median, from the trace's first
span) and how long it lasts (median and p90). Writes the same table and the bench's JSON to --out.

    .venv/bin/python -m benchmarks.peer.stage_timeline --rate 2 --bench-args "--random-prefix-len 768 --num-prompts 40" \
        --out benchmarks/results/prefix_cache/stages_rate2
Needs port 8000 free and the peer venv (bash ../shared/peer-bench/setup.sh). Tracing costs a little
(benchmarks/results/tracing_overhead.json); compare stages within one run, not with untraced runs.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from distserve.engine.model_loader import resolve_model_path
from tests.otlp_receiver import OtlpReceiver

ROOT = Path(__file__).resolve().parents[2]
PEER_BENCH = Path(os.environ.get("PEER_BENCH", ROOT.parent / "shared" / "peer-bench")) / "bench.sh"
URL, NAME = "http://127.0.0.1:8000", "distserve-small"


def wait_health(timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            urllib.request.urlopen(URL + "/health", timeout=1)
            return
        except OSError:
            if time.monotonic() > deadline:
                raise SystemExit("distserve up did not become healthy")
            time.sleep(1)


def bench(model_dir: str, rate: str, out: Path, *args: str) -> None:
    subprocess.run(["bash", str(PEER_BENCH), URL, NAME, model_dir, rate, str(out), *args], check=True,
                   capture_output=True)


def timeline(spans) -> list[str]:
    """One row per span name: traces having it, start offset p50, duration p50 and p90 (ms)."""
    traces = collections.defaultdict(list)
    for span in spans:
        traces[span.trace_id].append(span)
    starts, durations = collections.defaultdict(list), collections.defaultdict(list)
    for members in traces.values():
        first = min(s.start_ns for s in members)
        for span in members:
            key = f"{span.service}:{span.name}"
            starts[key].append((span.start_ns - first) / 1e6)
            durations[key].append((span.end_ns - span.start_ns) / 1e6)
    rows = [f"{len(traces)} traces", "| span | traces | start p50 ms | duration p50 ms | duration p90 ms |",
            "|---|---|---|---|---|"]
    for key in sorted(starts, key=lambda k: statistics.median(starts[k])):
        took = sorted(durations[key])
        rows.append(f"| {key} | {len(took)} | {statistics.median(starts[key]):.1f} | {statistics.median(took):.1f} "
                    f"| {took[int(0.9 * (len(took) - 1))]:.1f} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rate", default="2")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--bench-args", default="", help="passed to the measured bench run")
    parser.add_argument("--out", required=True)
    parser.add_argument("up_args", nargs="*", help="after --: flags for `distserve up`")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    receiver = OtlpReceiver().start()
    env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_EXPORTER_OTLP_INSECURE": "true",
           "OTEL_BSP_SCHEDULE_DELAY": "200"}
    up = subprocess.Popen([sys.executable, "-m", "distserve.cli", "up", "--dtype", args.dtype, "--gateway-port", "8000",
                           "--served-model-name", NAME, "--log-dir", str(out / "logs"), *args.up_args],
                          env=env, cwd=ROOT, stdout=open(out / "up.log", "w"), stderr=subprocess.STDOUT,
                          start_new_session=True)
    try:
        wait_health()
        model_dir = str(resolve_model_path("default:small"))
        bench(model_dir, "inf", out / "warmup.json", "--num-prompts", "8", "--seed", "1000")
        time.sleep(2)  # the warm-up's spans are exported
        receiver.spans.clear()
        bench(model_dir, args.rate, out / "bench.json", *shlex.split(args.bench_args), "--seed", "1")
        time.sleep(3)  # the last spans are exported
    finally:
        os.killpg(up.pid, signal.SIGTERM)
        up.wait(60)
        receiver.stop()
    result = json.loads((out / "bench.json").read_text())
    rows = timeline(receiver.spans) + [
        "", f"TTFT p50 {result['median_ttft_ms']:.1f} ms, TPOT p50 {result['median_tpot_ms']:.1f} ms, "
            f"{result['output_throughput']:.1f} output tok/s"]
    (out / "timeline.md").write_text("\n".join(rows) + "\n")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
