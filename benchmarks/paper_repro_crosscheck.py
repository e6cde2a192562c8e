"""Our simulator against DistServe's own (simdistserve) on the same requests, fleets and latency fits.

    python -m benchmarks.paper_repro_crosscheck --distserve-src DIR --python PY [--input-scale 1]
        [--out-dir benchmarks/results/paper_repro]

DIR: a checkout of github.com/LLMServe/DistServe (82831f1 was used); PY: a Python with simpy, numpy and
pandas (`python -m venv V && V/bin/pip install simpy numpy pandas tqdm`). Neither is a dependency of
ours: this benchmark only reads what their simulator prints.

For each fleet of benchmarks/paper_repro (vLLM without chunked prefill on one GPU; DistServe's prefill
TP2 + decode TP1) and each per-GPU rate of a fixed grid, both simulators run the same trace (our chat
mix clipped to 2048 tokens, Poisson arrivals, seed 0, written as their JSON workload) with the paper's
fits, and report the share of requests meeting TTFT 0.25 s and TPOT 0.1 s together. Goodput per GPU
is where that share crosses 90%, interpolated linearly between grid rates as the paper's plots do.
The token budgets are their simulator's (its profile_data/max_num_tokens.csv), not the servers'.
Their TPOT divides by output_len and ours by output_len - 1; each simulator keeps its own.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import tempfile

from benchmarks.paper_repro import FITTED_OPT_13B, KV_TOKENS, MAX_CONTEXT, SLO, fitted, scaled_trace
from benchmarks.results_io import write_results
from distserve.planner.goodput import Workload
from distserve.planner.simulator import ClusterConfig, WorkerSpec, simulate

RATES_PER_GPU = [0.25, 0.5, 1, 1.5, 2, 2.5, 3, 3.5, 4, 5, 6, 7, 8]
NUM_REQUESTS = 300
THEIR_BUDGET = {1: KV_TOKENS[1], 2: KV_TOKENS[2]}  # their prefill_max_tokens: the KV capacity proxy
FLEETS = {  # name: (their backend, tp prefill, tp decode, GPUs)
    "vllm": ("vllm", 1, 1, 1),
    "distserve": ("distserve", 2, 1, 3),
}


def our_config(name: str) -> ClusterConfig:
    if name == "vllm":
        return ClusterConfig((WorkerSpec("colocated", fitted("vllm", 1, THEIR_BUDGET[1]), max_running=10 ** 7,
                                         chunked_prefill=False),))
    return ClusterConfig((WorkerSpec("prefill", fitted("distserve", 2, THEIR_BUDGET[2])),
                          WorkerSpec("decode", fitted("distserve", 1, THEIR_BUDGET[1]), max_running=10 ** 7)))


def theirs(src: str, python: str, name: str, requests, rate: float) -> float:
    """Their simulator's joint attainment (0-1) for these requests."""
    backend, tp_prefill, tp_decode, _ = FLEETS[name]
    with tempfile.TemporaryDirectory() as scratch:
        workload, output = os.path.join(scratch, "workload.json"), os.path.join(scratch, "out.csv")
        with open(workload, "w") as f:
            json.dump([{"start_time": r.arrival_s, "prompt_len": r.input_len, "output_len": r.output_len}
                       for r in requests], f)
        subprocess.run([python, "simdistserve/benchmarks/simulate_dist.py", "--backend", backend,
                        "--model", "facebook/opt-13b", "--workload", workload, "--rate", str(rate),
                        "--N", str(len(requests)), "--seed", "0", "--tp-prefill", str(tp_prefill),
                        "--pp-prefill", "1", "--tp-decode", str(tp_decode), "--pp-decode", "1",
                        "--prefill-target", str(int(SLO.ttft_s * 1e3)),
                        "--decode-target", str(int(SLO.tpot_s * 1e3)), "--slo-scales", "[1]", "--slas", "[]",
                        "--output", output], cwd=src, env={**os.environ, "PYTHONPATH": src}, check=True,
                       capture_output=True)
        with open(output) as f:
            both = [row for row in csv.DictReader(f) if row["pd"] == "both"]
    return float(both[0]["attainment"]) / 100


def crossing(points: list[tuple[float, float]], target: float = 0.9) -> float:
    """The rate where attainment first falls below `target`, interpolated linearly between grid points."""
    previous = None
    for rate, attained in points:
        if attained < target:
            if previous is None:
                return 0.0
            (r0, a0), (r1, a1) = previous, (rate, attained)
            return r0 + (a0 - target) * (r1 - r0) / (a0 - a1)
        previous = (rate, attained)
    return points[-1][0]


def run(src: str, python: str, input_scale: float) -> dict:
    trace = scaled_trace(Workload("chat", max_context=MAX_CONTEXT), NUM_REQUESTS, 0, input_scale)
    out: dict = {"rates_per_gpu": RATES_PER_GPU, "num_requests": NUM_REQUESTS, "fits": sorted(map(str, FITTED_OPT_13B)),
                 "input_scale": input_scale, "mean_input": trace.mean_input, "fleets": {}}
    for name, (_, _, _, gpus) in FLEETS.items():
        ours_points, their_points = [], []
        for per_gpu in RATES_PER_GPU:
            requests = trace.at_rate(per_gpu * gpus)
            ours_points.append((per_gpu, simulate(our_config(name), requests, SLO).summary.attainment))
            their_points.append((per_gpu, theirs(src, python, name, requests, per_gpu * gpus)))
        out["fleets"][name] = {"gpus": gpus, "ours": ours_points, "theirs": their_points,
                               "goodput_per_gpu": {"ours": crossing(ours_points), "theirs": crossing(their_points)}}
    goodput = {who: out["fleets"]["distserve"]["goodput_per_gpu"][who] / out["fleets"]["vllm"]["goodput_per_gpu"][who]
               for who in ("ours", "theirs")}
    out["distserve_over_vllm"] = goodput
    return out


def markdown(result: dict) -> str:
    lines = ["# Our simulator against DistServe's simdistserve, same requests and fits (SIMULATED)", "",
             f"Prompts x{result['input_scale']:g} (mean {result['mean_input']:.0f} tokens).", "",
             "Joint attainment (TTFT 250 ms and TPOT 100 ms) at each per-GPU rate, ours / theirs:", "",
             "| rate per GPU | " + " | ".join(result["fleets"]) + " |", "|---|" + "---|" * len(result["fleets"])]
    for i, rate in enumerate(result["rates_per_gpu"]):
        cells = [f"{f['ours'][i][1]:.0%} / {f['theirs'][i][1]:.0%}" for f in result["fleets"].values()]
        lines.append(f"| {rate:g} | " + " | ".join(cells) + " |")
    lines += ["", "Goodput per GPU at 90%, ours / theirs: " + "; ".join(
        f"{name} {f['goodput_per_gpu']['ours']:.2f} / {f['goodput_per_gpu']['theirs']:.2f}"
        for name, f in result["fleets"].items()),
        f"DistServe / vLLM: ours {result['distserve_over_vllm']['ours']:.2f}, "
        f"theirs {result['distserve_over_vllm']['theirs']:.2f} (the paper measured 4.6 on its ShareGPT trace).", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--distserve-src", required=True)
    parser.add_argument("--python", required=True)
    parser.add_argument("--input-scale", type=float, default=1.0, help="prompts this many times our chat mix's")
    parser.add_argument("--out-dir", default="benchmarks/results/paper_repro")
    args = parser.parse_args()
    result = run(args.distserve_src, args.python, args.input_scale)
    name = f"crosscheck_x{args.input_scale:g}"
    write_results(f"{args.out_dir}/{name}.json", result, printed={})
    text = markdown(result)
    with open(f"{args.out_dir}/{name}.md", "w") as out:
        out.write(text)
    print(text)


if __name__ == "__main__":
    main()
