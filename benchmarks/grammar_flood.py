"""What a flood of slow structured-output specs costs everyone else's requests.

    python -m benchmarks.grammar_flood --out benchmarks/results/security/grammar_flood.json

Starts a real system (1 prefill + 1 decode worker, router; `default:small` unless --model) and measures
ordinary requests (a 128-token prompt, 64 tokens out, one at a time) streamed from the router: time to
first token and time per output token, first unloaded, then while `--flooders` clients each send one
distinct ambiguous recursive grammar after another (every one runs past the router's compile deadline,
is refused, and costs the compile's fork; the router's CPU budget spaces them). Records the flood's
refusals and how long each took. The issue's target: TPOT within 20% of unloaded.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time

import grpc

from benchmarks.results_io import write_results
from distserve.engine.default_model import ensure_default_model
from distserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from tests.cluster_helpers import running_cluster
from tests.faults.conftest import faults_spec


def slow_grammar(salt: int) -> str:
    """8 KiB that xgrammar works on for minutes; `salt` makes each one distinct (no cached verdict)."""
    return "root ::= r0\n" + "\n".join(
        f'r{i} ::= r{i + 1} r{i + 1} | "a{salt}x{i}" r{i + 1} | [^q]*' for i in range(200)) + '\nr200 ::= "b"'


def timed_request(stub, prompt: list[int], max_tokens: int) -> tuple[float, float]:
    """(TTFT s, TPOT s) of one greedy request streamed from the router."""
    request = router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=prompt), sampling=common_pb2.SamplingParams(
        max_tokens=max_tokens, temperature=0, ignore_eos=True))
    started = time.perf_counter()
    arrivals = []
    for message in stub.Generate(request, timeout=300):
        arrivals += [time.perf_counter()] * len(message.token_ids)
    return arrivals[0] - started, (arrivals[-1] - arrivals[0]) / (len(arrivals) - 1)


def measure(stub, requests: int, max_tokens: int) -> dict:
    ttfts, tpots = zip(*(timed_request(stub, list(range(100, 228)), max_tokens) for _ in range(requests)))
    return {"ttft_ms_p50": 1e3 * statistics.median(ttfts), "tpot_ms_p50": 1e3 * statistics.median(tpots),
            "tpot_ms": [round(1e3 * t, 2) for t in tpots]}


def flood(address: str, stop: threading.Event, refusals: list, first_salt: int) -> None:
    with grpc.insecure_channel(address) as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)
        salt = first_salt
        while not stop.is_set():
            salt += 1
            request = router_pb2.GenerateRequest(text="hi", sampling=common_pb2.SamplingParams(
                max_tokens=4, structured_output=common_pb2.StructuredOutput(grammar=slow_grammar(salt))))
            started = time.perf_counter()
            try:
                list(stub.Generate(request, timeout=60))
                refusals.append(("accepted", time.perf_counter() - started))
            except grpc.RpcError as exc:
                refusals.append((exc.code().name, time.perf_counter() - started))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--flooders", type=int, default=2)
    parser.add_argument("--deadline-s", type=float, default=2.0, help="the router's grammar_compile_timeout_s")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    model = ensure_default_model(args.model)
    spec = faults_spec(model, tempfile.mkdtemp(prefix="grammar-flood-"), num_prefill=1, num_decode=1,
                       gateway_port=None, supervise=False, state_file="",
                       env={"DISTSERVE_DTYPE": "float32",
                            "DISTSERVE_ROUTER_GRAMMAR_COMPILE_TIMEOUT_S": str(args.deadline_s)})
    with running_cluster(spec, 1, 1) as cluster, grpc.insecure_channel(cluster.router_address) as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)
        warm = router_pb2.GenerateRequest(text="hi", sampling=common_pb2.SamplingParams(
            max_tokens=2, structured_output=common_pb2.StructuredOutput(regex="[a-z]+")))
        list(stub.Generate(warm, timeout=300))  # the compiler process is up
        measure(stub, 2, args.max_tokens)  # warm-up
        unloaded = measure(stub, args.requests, args.max_tokens)
        stop, refusals = threading.Event(), []
        flooders = [threading.Thread(target=flood, args=(cluster.router_address, stop, refusals, 1000 * i))
                    for i in range(args.flooders)]
        for thread in flooders:
            thread.start()
        time.sleep(args.deadline_s)
        flooded = measure(stub, args.requests, args.max_tokens)
        stop.set()
        for thread in flooders:
            thread.join()
    refusal_s = [seconds for code, seconds in refusals if code == "INVALID_ARGUMENT"]
    result = {
        "model": args.model, "dtype": "float32", "deadline_s": args.deadline_s, "flooders": args.flooders,
        "unloaded": unloaded, "flooded": flooded,
        "tpot_ratio": flooded["tpot_ms_p50"] / unloaded["tpot_ms_p50"],
        "ttft_ratio": flooded["ttft_ms_p50"] / unloaded["ttft_ms_p50"],
        "flood": {"answers": len(refusals), "codes": sorted({code for code, _ in refusals}),
                  "refused": len(refusal_s), "refusal_s_p50": statistics.median(refusal_s) if refusal_s else None,
                  "refusal_s_max": max(refusal_s, default=None)},
    }
    write_results(args.out, result)


if __name__ == "__main__":
    main()
