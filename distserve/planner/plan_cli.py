"""`distserve plan`: the fleet with the best predicted goodput per device, from profiles and a simulator.

    distserve plan --profile small-1core.json --profile small-2core.json --cores 2 \
        --workload chat --slo-ttft-ms 2000 --slo-tpot-ms 200 [--rate 2] [--top 5] [--json plan.json]
    distserve plan --roofline a100-80gb:llama-13b --gpus 2x4 --workload chat --slo-ttft-ms 400 --slo-tpot-ms 60
    distserve plan --profile small-1core.json --simulate 1p1d --rates 1,2,4 --workload chat \
        [--slo-ttft-ms 2000 --slo-tpot-ms 200]

--simulate runs one fleet (fleet strings: see fleet_spec.py, e.g. "1p1d", "2c", "2p@1:512+1d@2")
at each rate instead of searching, for checking the simulator against measurements.
--roofline synthesizes profiles (tensor-parallel degree 1, 2, 4, 8) for hardware we do not have:
SIMULATED, not measured (see roofline.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from distserve.planner import plan_report
from distserve.planner.fleet_spec import parse_workers
from distserve.planner.goodput import POOL, RateSearch, Trace, Workload, lone_latency, run_config
from distserve.planner.placement import DeviceBudget, place
from distserve.planner.profile import Profile
from distserve.planner.roofline import HARDWARE, MODELS, roofline_profiles
from distserve.planner.search import SearchSpace, plan
from distserve.planner.sim_metrics import Slo
from distserve.planner.simulator import ClusterConfig, simulate


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_argument_group("profiles (one or more sizes per worker)")
    source.add_argument("--profile", action="append", default=[], help="profile JSON from `distserve profile`")
    source.add_argument("--roofline", default="", help="SIMULATED profiles for HARDWARE:MODEL, e.g. "
                        f"a100-80gb:llama-13b (have: {', '.join(HARDWARE)} / {', '.join(MODELS)})")
    hw = parser.add_mutually_exclusive_group()
    hw.add_argument("--cores", type=int, help="plan for one machine with this many cores")
    hw.add_argument("--gpus", help="plan for NODESxPER GPUs, e.g. 1x8 or 2x4")
    parser.add_argument("--inter-node-gbps", type=float, default=None,
                        help="KV bandwidth between nodes in GB/s (default: the roofline hardware's, else 25)")
    load = parser.add_argument_group("workload and targets")
    load.add_argument("--workload", default="chat", choices=("chat", "code", "summarize", "fixed"))
    load.add_argument("--input-len", help="fixed workload: N or A-B")
    load.add_argument("--output-len", help="fixed workload: N or A-B")
    load.add_argument("--max-context", type=int, help="clip input + output to this many tokens")
    load.add_argument("--slo-ttft-ms", type=float, help="time-to-first-token target")
    load.add_argument("--slo-tpot-ms", type=float, help="time-per-output-token target")
    load.add_argument("--rate", type=float, help="also report each listed fleet's attainment at this rate")
    load.add_argument("--num-requests", type=int, default=300, help="simulated requests per rate probe (at least)")
    load.add_argument("--span-latencies", type=float, default=RateSearch.span_latencies,
                      help="more requests when that many would arrive within this many lone-request latencies")
    load.add_argument("--max-running", type=int, default=64, help="decode batch cap per decode/colocated worker")
    load.add_argument("--seed", type=int, default=0)
    search = parser.add_argument_group("search")
    search.add_argument("--top", type=int, default=5, help="fleets to list")
    search.add_argument("--objective", default="per-device", choices=("per-device", "total"))
    search.add_argument("--budget-factors", default="0.5,1,2",
                        help="prefill/colocated token budgets tried, as multiples of the profile's")
    search.add_argument("--max-simulated", type=int, default=32, help="candidates simulated whole")
    search.add_argument("--no-mixed", action="store_true", help="leave out fleets mixing colocated and P/D")
    search.add_argument("--json", default="", help="also write the result here")
    parser.add_argument("--frontend-us-per-token", type=float, default=0.0,
                        help="CPU microseconds the router, gateway and client spend per streamed token, taken from "
                             "the workers' cores when the machine has none to spare (--cores): charged to a decode step "
                             "while no other worker of its node is idle (measure it with "
                             "benchmarks/goodput/frontend_cost.py)")
    sim = parser.add_argument_group("simulate one fleet instead of searching")
    sim.add_argument("--simulate", default="", help="fleet string, e.g. 1p1d, 2c, 1p1d1c, 2p@1:512+1d@2")
    sim.add_argument("--rates", default="1,2,4", help="comma-separated request rates for --simulate")
    sim.add_argument("--router-overhead-ms", type=float, default=0.0,
                     help="--simulate: add the router's own hop to every TTFT and end-to-end latency")


def load_profiles(args: argparse.Namespace) -> list[Profile]:
    profiles = [Profile.load(p) for p in args.profile]
    if args.roofline:
        hw_name, _, model_name = args.roofline.lower().partition(":")
        if hw_name not in HARDWARE or model_name not in MODELS:
            raise ValueError(f"--roofline: expected HARDWARE:MODEL from {sorted(HARDWARE)} and {sorted(MODELS)}, "
                             f"got {args.roofline!r}")
        profiles += roofline_profiles(MODELS[model_name], HARDWARE[hw_name])
    if not profiles:
        raise ValueError("give at least one --profile (or --roofline)")
    return profiles


def device_budget(args: argparse.Namespace, profiles: list[Profile]) -> DeviceBudget | None:
    hw = HARDWARE.get(args.roofline.lower().partition(":")[0])
    gbps = args.inter_node_gbps or (hw.inter_node_bytes_per_s / 1e9 if hw else 25.0)
    if args.gpus:
        return DeviceBudget.gpus(args.gpus, inter_node_bytes_per_s=gbps * 1e9)
    if args.cores:
        return dataclasses.replace(DeviceBudget.cores(args.cores), frontend_s_per_token=args.frontend_us_per_token / 1e6)
    return None


def _slo(args: argparse.Namespace, required: bool) -> Slo | None:
    if args.slo_ttft_ms is None or args.slo_tpot_ms is None:
        if required:
            raise ValueError("--slo-ttft-ms and --slo-tpot-ms are needed to plan")
        return None
    return Slo(args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3)


def _workload(args: argparse.Namespace) -> Workload:
    return Workload(args.workload, args.input_len, args.output_len, args.max_context)


def run(args: argparse.Namespace) -> int:
    """Plans (or simulates one fleet); prints the result; returns an exit status."""
    try:
        profiles = load_profiles(args)
        budget = device_budget(args, profiles)
        if args.simulate:
            return _simulate(args, profiles, budget)
        if budget is None:
            raise ValueError("give --cores N or --gpus NODESxPER")
        return _plan(args, profiles, budget)
    except (ValueError, OSError) as exc:
        print(f"distserve plan: {exc}")
        return 2


def _simulate(args: argparse.Namespace, profiles: list[Profile], budget: DeviceBudget | None) -> int:
    workers = parse_workers(args.simulate, profiles, args.max_running)
    config = place(workers, budget) if budget else ClusterConfig(tuple(workers))
    if config is None:
        raise ValueError(f"fleet {args.simulate!r} does not fit {budget.label()}")
    config = dataclasses.replace(config, router_overhead_s=args.router_overhead_ms / 1e3,
                                 frontend_s_per_token=args.frontend_us_per_token / 1e6)
    rates = [float(r) for r in args.rates.split(",") if r.strip()]
    summaries = run_config(profiles, config, _workload(args), rates, _slo(args, False), args.num_requests,
                           args.seed)
    print(plan_report.format_simulation(args.simulate, summaries))
    if args.json:
        _write_json(args.json, {"fleet": args.simulate, "simulated": True,
                                "rates": {str(r): s.to_dict() for r, s in summaries.items()}})
    return 0


def _plan(args: argparse.Namespace, profiles: list[Profile], budget: DeviceBudget) -> int:
    slo, workload = _slo(args, True), _workload(args)
    trace = Trace.draw(workload, args.num_requests, args.seed, pool=POOL)
    space = SearchSpace(budget_factors=tuple(float(f) for f in args.budget_factors.split(",")),
                        include_mixed=not args.no_mixed, max_simulated=args.max_simulated, max_running=args.max_running,
                        objective=args.objective)
    started = time.monotonic()
    ranked = plan(profiles, budget, trace, slo, space, RateSearch(span_latencies=args.span_latencies))
    if not ranked:
        raise ValueError(f"no fleet of these profiles fits {budget.label()}")
    shown = ranked[:args.top]
    at_rate = ({i: simulate(r.candidate.config, trace.at_rate(args.rate), slo).summary
                for i, r in enumerate(shown)} if args.rate else {})
    print(f"distserve plan: {budget.label()}; workload {workload.name} ({args.num_requests} requests, seed "
          f"{args.seed}); SLO {slo.label()}, >= 90% of requests")
    print("profiles: " + "; ".join(plan_report.describe_profile(p) for p in profiles))
    print(f"{len(ranked)} fleets simulated in {time.monotonic() - started:.1f} s "
          f"(predictions from the simulator, not measurements)\n")
    print(plan_report.format_best(ranked[0], budget, args.rate, at_rate.get(0)))
    best_by_family, misses = _family_misses(ranked, trace, slo, args.span_latencies)
    print("\n" + plan_report.format_recommendation(best_by_family, misses, budget.unit))
    print("\n" + plan_report.format_table(shown, budget, args.rate, at_rate))
    if args.objective == "per-device":
        print(f"(per-{budget.unit} goodputs within {RateSearch.rel_tol:.0%} of the best are ties of the rate search; "
              "the larger goodput is listed first)")
    if args.json:
        _write_json(args.json, _plan_json(args, profiles, budget, slo, ranked[:max(args.top, 1)], at_rate) | {
            "recommendation": {family: {"fleet": r.candidate.fleet, "per_device_rps": r.per_device,
                                        "misses_past_goodput": dict(zip(("ttft", "tpot"), misses[family]))}
                               for family, r in best_by_family.items()}})
    return 0


def _family_misses(ranked: list, trace: Trace, slo: Slo, span_latencies: float) -> tuple[dict, dict]:
    """Each family's best fleet, and the SLO misses each has just past its own goodput (as many requests
    as the goodput search's probes there)."""
    best_by_family: dict = {}
    for r in ranked:
        best_by_family.setdefault(r.candidate.family, r)
    misses = {}
    for family, r in best_by_family.items():
        config, rate = r.candidate.config, max(r.goodput.rate, 1e-3) * plan_report.PAST_KNEE
        requests = trace.at_rate(rate, span_latencies * lone_latency(config, trace) if span_latencies else 0.0)
        misses[family] = plan_report.misses_past_knee(simulate(config, requests).results, slo)
    return best_by_family, misses


def _plan_json(args, profiles, budget, slo, shown, at_rate) -> dict:
    return {"budget": dataclasses.asdict(budget) | {"label": budget.label()},
            "workload": dataclasses.asdict(_workload(args)), "num_requests": args.num_requests, "seed": args.seed,
            "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s, "target": 0.9}, "objective": args.objective,
            "profiles": [plan_report.describe_profile(p) for p in profiles],
            "best": shown[0].to_dict(budget.unit), "candidates": [r.to_dict(budget.unit) for r in shown],
            "at_rate": {"rate": args.rate, "summaries": [at_rate[i].to_dict() for i in sorted(at_rate)]}
            if args.rate else None}


def _write_json(path: str, data: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=1, default=float) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="distserve plan", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))
