"""How fast excess load is turned away, and whether memory stays bounded under it.

    python -m benchmarks.admission_latency --out benchmarks/results/admission_latency.json

Starts a real system (tiny model: 1 prefill worker with a small queue cap, 1 decode worker, gateway)
and floods the HTTP gateway with far more concurrent requests than the prefill queue admits, for a
fixed time. Records every answer's status and latency: the 429s (with Retry-After) should come
back within ~100 ms while admitted requests are served, and the workers' resident memory should not
grow with the offered load.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time

import aiohttp

from benchmarks.results_io import write_results
from distserve.engine.default_model import ensure_default_model
from tests.cluster_helpers import running_cluster
from tests.faults.conftest import faults_spec


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kib / 1024


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else (values or [0.0])[0]


async def client(session: aiohttp.ClientSession, url: str, until: float, answers: list) -> None:
    """Sends one request after another until `until`; records (status, seconds, Retry-After)."""
    body = {"model": "distserve-tiny", "prompt": list(range(10, 138)), "max_tokens": 8, "ignore_eos": True}
    while time.monotonic() < until:
        started = time.monotonic()
        async with session.post(url, json=body) as response:
            await response.read()
            answers.append((response.status, time.monotonic() - started, response.headers.get("Retry-After")))


async def flood(gateway_url: str, concurrency: int, seconds: float) -> list:
    answers: list = []
    until = time.monotonic() + seconds
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as session:
        await asyncio.gather(*(client(session, gateway_url + "/v1/completions", until, answers)
                               for _ in range(concurrency)))
    return answers


def summarize(answers: list) -> dict:
    by_status: dict[int, list[float]] = {}
    for status, seconds, _ in answers:
        by_status.setdefault(status, []).append(seconds)
    refused = by_status.get(429, [])
    return {
        "answers": len(answers),
        "by_status": {str(status): len(times) for status, times in sorted(by_status.items())},
        "refused_p50_ms": round(percentile(refused, 50) * 1e3, 1) if refused else None,
        "refused_p99_ms": round(percentile(refused, 99) * 1e3, 1) if refused else None,
        "refused_max_ms": round(max(refused) * 1e3, 1) if refused else None,
        "refused_with_retry_after": sum(1 for status, _, after in answers if status == 429 and after),
        "served_p50_ms": round(percentile(by_status.get(200, []), 50) * 1e3, 1) if 200 in by_status else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--max-queued-tokens", type=int, default=512)
    parser.add_argument("--out", default="benchmarks/results/admission_latency.json")
    args = parser.parse_args()
    prefill_args = ["--max-batch-tokens", "256", "--max-queued-tokens", str(args.max_queued_tokens)]
    spec = faults_spec(str(ensure_default_model("tiny")), tempfile.mkdtemp(prefix="admission-"), num_prefill=1,
                       num_decode=1, prefill_args=prefill_args, supervise=False)
    with running_cluster(spec, 1, 1) as cluster:
        pids = {name: cluster.processes[name].popen.pid for name in ("prefill-0", "decode-0", "router", "gateway")}
        rss_before = {name: round(rss_mib(pid), 1) for name, pid in pids.items()}
        answers = asyncio.run(flood(cluster.gateway_url, args.concurrency, args.seconds))
        rss_after = {name: round(rss_mib(pid), 1) for name, pid in pids.items()}
    result = {"command": "python -m benchmarks.admission_latency " + " ".join(
                  f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"),
              "prompt_tokens": 128, "max_tokens": 8, **summarize(answers),
              "rss_mib_before": rss_before, "rss_mib_after": rss_after}
    write_results(args.out, result)


if __name__ == "__main__":
    main()
