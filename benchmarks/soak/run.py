"""Soak benchmark: many short requests through the gateway while children are killed, then a leak check.

    .venv/bin/python -m benchmarks.soak.run --requests 10000 --concurrency 24 --seed 0

Starts a supervised system on the tiny model (Redis, kvbroker, router, 2 prefill + 2 decode
workers, gateway; float32, the faults suite's short leases), takes reference answers for a
pool of greedy and seeded requests, then sends --requests short requests (completions and
chat, streamed or not, some cancelled by the client) at --concurrency, killing (-9) a decode
worker, a prefill worker, the kvbroker, Redis, the router or the gateway --faults times
(see faults.py). Every request is judged (classify.py); at the end the system must be back
up with nothing leaked. Writes benchmarks/results/soak/{results.json,summary.md}; exits 1 on
any bad request, leak or unrecovered fault. The children's logs stay in --log-dir.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp

from benchmarks.soak import report
from benchmarks.soak.classify import BAD, CLEAR_ERROR, COMPLETED, classify
from benchmarks.soak.client import Outcome, send
from benchmarks.soak.faults import Injector, Tracker, schedule
from benchmarks.soak.leaks import children_state, wait_clean
from benchmarks.soak.workload import Planned, plan, reference_pool
from distserve.engine.default_model import ensure_default_model
from distserve.launcher import Cluster
from tests.cluster_helpers import wait_for_workers
from tests.faults.conftest import NUM_DECODE, NUM_PREFILL, faults_spec

BACKOFF_S = 0.5  # after a clear error a client waits this long, as one honouring Retry-After would


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10_000, help="requests to send")
    parser.add_argument("--concurrency", type=int, default=24, help="requests in flight at once")
    parser.add_argument("--faults", type=int, default=20, help="kills, spread evenly over the run")
    parser.add_argument("--seed", type=int, default=0, help="seeds the requests and the faults")
    parser.add_argument("--bound-s", type=float, default=60.0, help="a request still open after this hangs")
    parser.add_argument("--log-dir", default="", help="children's logs (default: a new temporary folder)")
    parser.add_argument("--routers", type=int, default=1, help="router replicas (the gateway resumes streams)")
    parser.add_argument("--kvbrokers", type=int, default=1, help="kvbroker replicas (clients fail over)")
    parser.add_argument("--out-dir", default="benchmarks/results/soak")
    return parser.parse_args(argv)


async def take_references(session: aiohttp.ClientSession, gateway_url: str, model: str,
                          pool: dict[str, tuple[str, dict]], bound_s: float) -> dict[str, Outcome]:
    """Each pool request's answer before any fault (non-streaming); raises if one does not complete."""
    plans = {key: Planned(-1, endpoint, body, stream=False, reference_key=key)
             for key, (endpoint, body) in pool.items()}
    outcomes = await asyncio.gather(*(send(session, gateway_url, model, p, bound_s) for p in plans.values()))
    references = dict(zip(plans, outcomes))
    for key, outcome in references.items():
        cls, reason = classify(plans[key], outcome, {}, during_gateway_fault=False)
        if cls != COMPLETED:
            raise RuntimeError(f"reference {key} did not complete: {reason} {outcome}")
    return references


async def drive(cluster: Cluster, model: str, plans: list[Planned], injector: Injector, tracker: Tracker,
                references: dict[str, Outcome], concurrency: int, bound_s: float) -> list[report.Judged]:
    """Sends every plan from `concurrency` clients while the injector runs; each request judged."""
    judged: list[report.Judged] = []
    pending = iter(plans)
    position = {id(f): k for k, f in enumerate(injector.faults)}

    async def client(session: aiohttp.ClientSession) -> None:
        for planned in pending:
            await injector.ready_for(planned.index)
            tracker.start(planned.index)
            outcome = await send(session, cluster.gateway_url, model, planned, bound_s)
            tracker.finish(planned.index)
            faults = tracker.faults_of[planned.index]
            cls, reason = classify(planned, outcome, references, any(f.kind == "gateway" for f in faults))
            judged.append(report.Judged(planned.index, planned.endpoint, planned.stream, planned.action,
                                        planned.reference_key, cls, reason,
                                        outcome.error or outcome.transport or outcome.malformed, outcome.latency_s,
                                        [position[id(f)] for f in faults], planned.body))
            _progress(judged, len(plans))
            if cls == CLEAR_ERROR:
                await asyncio.sleep(BACKOFF_S)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True)) as session:
        faulting = asyncio.create_task(injector.run())
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
        await faulting
    return judged


def _progress(judged: list[report.Judged], total: int) -> None:
    if len(judged) % max(1, total // 20) == 0:
        counts = {c: sum(j.cls == c for j in judged) for c in report.CLASSES}
        print(f"{time.strftime('%H:%M:%S')} {len(judged)}/{total} {counts}", flush=True)


def served_model(gateway_url: str) -> str:
    with urllib.request.urlopen(gateway_url + "/v1/models", timeout=10) as reply:
        return json.load(reply)["data"][0]["id"]


async def soak(cluster: Cluster, args: argparse.Namespace) -> tuple[list[report.Judged], Injector]:
    rng = random.Random(args.seed)
    pool = reference_pool(rng)
    plans = [plan(rng, i, pool) for i in range(args.requests)]
    model = served_model(cluster.gateway_url)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=8, force_close=True)) as session:
        references = await take_references(session, cluster.gateway_url, model, pool, args.bound_s)
    print(f"{len(references)} reference answers taken; sending {args.requests} requests", flush=True)
    tracker = Tracker()
    injector = Injector(cluster, random.Random(args.seed + 1), schedule(rng, args.requests, args.faults), tracker,
                        NUM_PREFILL, NUM_DECODE)
    judged = await drive(cluster, model, plans, injector, tracker, references, args.concurrency, args.bound_s)
    return sorted(judged, key=lambda j: j.index), injector


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = shlex.join(["python", "-m", "benchmarks.soak.run", *(sys.argv[1:] if argv is None else argv)])
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="distserve-soak-")
    print(f"children's logs: {log_dir}", flush=True)
    cluster = Cluster(faults_spec(str(ensure_default_model("tiny")), log_dir, num_routers=args.routers,
                                  num_kvbrokers=args.kvbrokers)).start()
    started = time.monotonic()
    try:
        wait_for_workers(cluster, NUM_PREFILL, NUM_DECODE)
        judged, injector = asyncio.run(soak(cluster, args))
        leaks = wait_clean(cluster, NUM_PREFILL, NUM_DECODE)
        children = children_state(cluster)
    finally:
        wall_s = time.monotonic() - started
        cluster.stop()
    result = report.build(vars(args), judged, injector.faults, wall_s, leaks, children, log_dir, command)
    ok = (not result["counts"][BAD] and not leaks["leaked"] and all(c["up"] for c in children.values())
          and not any(f.error for f in injector.faults))
    report.write(Path(args.out_dir), result, ok)
    print(report.summary(result), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
