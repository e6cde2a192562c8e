"""End-to-end latency of single requests through the whole system, and the KV transfer inside them.

    python -m benchmarks.request_latency --model default:small --prompt-len 512 --max-tokens 64 \
        --requests 5 --out benchmarks/results/request_latency.json

Starts Redis, kvbroker, router, one prefill and one decode worker (real
processes), sends one warm-up request, then `requests` sequential requests.
Records client-side time to first token and end-to-end latency, the stage
timings the system reports, and transfer bandwidth (handle bytes / transfer_s).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import grpc

from benchmarks.results_io import write_results
from distserve.engine.model_loader import resolve_model_path
from distserve.engine.dtype import torch_dtype
from distserve.model_spec import load_model_spec
from distserve.launcher import Cluster, ClusterSpec
from distserve.v1 import common_pb2, router_pb2, router_pb2_grpc


def one_request(stub, prompt: list[int], max_tokens: int) -> dict:
    request = router_pb2.GenerateRequest(
        token_ids=router_pb2.TokenIds(ids=prompt),
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    started = time.perf_counter()
    first_at, last = None, None
    for message in stub.Generate(request, timeout=600):
        first_at = first_at or time.perf_counter()
        last = message
    done = time.perf_counter()
    t = last.timings
    return {"ttft_s": first_at - started, "e2e_s": done - started, "completion_tokens": last.usage.completion_tokens,
            "tpot_s": (done - first_at) / max(1, last.usage.completion_tokens - 1),
            "queue_s": t.queue_s, "prefill_s": t.prefill_s, "transfer_s": t.transfer_s,
            "decode_s": t.decode_s, "server_first_token_s": t.first_token_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default:small")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--requests", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results/request_latency.json")
    args = parser.parse_args()
    path = resolve_model_path(args.model)
    spec = load_model_spec(path)
    cluster = Cluster(ClusterSpec(model=path, router_port=0, broker_port=0, prefill_base_port=0,
                                  decode_base_port=0, redis_port=0, gateway_port=None,
                                  env={"DISTSERVE_DTYPE": args.dtype})).start()
    try:
        time.sleep(2.0)  # registry heartbeat + router refresh + decode pre-connect
        prompt = [(i * 7919) % (spec.vocab_size - 10) + 3 for i in range(args.prompt_len)]
        with grpc.insecure_channel(cluster.router_address) as channel:
            stub = router_pb2_grpc.RouterServiceStub(channel)
            warmup = one_request(stub, prompt, 4)
            rows = [one_request(stub, prompt, args.max_tokens) for _ in range(args.requests)]
    finally:
        cluster.stop()
    kv_bytes = spec.kv_bytes_per_token(torch_dtype(args.dtype)) * args.prompt_len
    summary = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
    summary["transfer_gbps"] = kv_bytes / summary["transfer_s"] / 1e9
    result = {"model": path, "dtype": args.dtype, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
              "kv_bytes": kv_bytes, "warmup": warmup, "median": summary, "rows": rows,
              "cpus": os.cpu_count(), "when": time.strftime("%Y-%m-%dT%H:%M:%S")}
    write_results(args.out, result, {"kv_bytes": kv_bytes, "warmup": warmup, "median": summary})


if __name__ == "__main__":
    main()
