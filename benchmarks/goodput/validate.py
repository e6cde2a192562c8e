"""The simulator against measurements: for each measured configuration of a `distserve bench` run, the
simulated SLO attainment at the same rates, on the same requests (same lengths, same arrival times).

    python -m benchmarks.goodput.validate --profile benchmarks/results/profiles/small-bfloat16-1core.json \
        --profile benchmarks/results/profiles/small-bfloat16-2core.json \
        --results benchmarks/results/goodput/prefill-heavy --results benchmarks/results/goodput/decode-heavy \
        --configs 1p1d,2c --out benchmarks/results/goodput/validation

Each results folder holds one sub-folder per configuration (its results.json), named by the fleet string
the simulator takes (1p1d, 2c, ...). Writes OUT.md (a table per workload: measured and simulated
attainment per rate, and the difference in percentage points) and OUT.png (measured solid, simulated
dashed).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from distserve.planner.fleet_spec import parse_workers
from distserve.planner.goodput import Workload, run_config
from distserve.planner.profile import Profile
from distserve.planner.sim_metrics import Slo
from distserve.planner.simulator import ClusterConfig

def simulated_attainment(profiles: list[Profile], fleet: str, results: dict, router_overhead_s: float,
                         frontend_s_per_token: float) -> dict[float, float]:
    workload = results["workload"]
    rates = [float(r["rate"]) for r in results["rates"] if r["rate"] != "inf"]
    slo = Slo(results["slo"]["ttft_ms"] / 1e3, results["slo"]["tpot_ms"] / 1e3)
    config = ClusterConfig(tuple(parse_workers(fleet, profiles)), router_overhead_s=router_overhead_s,
                           frontend_s_per_token=frontend_s_per_token)
    summaries = run_config(profiles, config, Workload(workload["name"], workload["input_len"], workload["output_len"]),
                           rates, slo, num_requests=workload["num_prompts"], seed=workload["seed"])
    return {rate: summary.attainment for rate, summary in summaries.items()}


def compare(profiles: list[Profile], folder: Path, configs: list[str], router_overhead_s: float,
            frontend_s_per_token: float) -> list[dict]:
    rows = []
    for fleet in configs:
        results = json.loads((folder / fleet / "results.json").read_text())
        simulated = simulated_attainment(profiles, fleet, results, router_overhead_s, frontend_s_per_token)
        for rate in results["rates"]:
            if rate["rate"] == "inf":
                continue
            rows.append({"workload": folder.name, "fleet": fleet, "rate": float(rate["rate"]),
                         "measured": rate["attainment"], "simulated": simulated[float(rate["rate"])],
                         "slo": results["slo"]})
    return rows


def markdown(rows: list[dict]) -> str:
    lines = []
    for workload in dict.fromkeys(r["workload"] for r in rows):
        chosen = [r for r in rows if r["workload"] == workload]
        slo = chosen[0]["slo"]
        lines += [f"### {workload} (SLO: TTFT <= {slo['ttft_ms']:g} ms, TPOT <= {slo['tpot_ms']:g} ms)", "",
                  "| fleet | rate (req/s) | measured attainment | simulated | difference (pp) |",
                  "|---|---|---|---|---|"]
        for r in chosen:
            diff = (r["simulated"] - r["measured"]) * 100
            lines.append(f"| {r['fleet']} | {r['rate']:g} | {r['measured']:.1%} | {r['simulated']:.1%} | "
                         f"{diff:+.1f} |")
        worst = max(abs(r["simulated"] - r["measured"]) for r in chosen) * 100
        lines += ["", f"Largest difference: {worst:.1f} percentage points.", ""]
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    fig, axes = plt.subplots(1, len(workloads), figsize=(6 * len(workloads), 4.2), squeeze=False)
    for ax, workload in zip(axes[0], workloads):
        for i, fleet in enumerate(dict.fromkeys(r["fleet"] for r in rows if r["workload"] == workload)):
            chosen = [r for r in rows if r["workload"] == workload and r["fleet"] == fleet]
            rates = [r["rate"] for r in chosen]
            color = f"C{i}"
            ax.plot(rates, [r["measured"] * 100 for r in chosen], "o-", color=color, label=f"{fleet} measured")
            ax.plot(rates, [r["simulated"] * 100 for r in chosen], "s--", color=color, label=f"{fleet} simulated")
        ax.axhline(90, color="grey", linewidth=0.8, linestyle=":")
        ax.set(title=workload, xlabel="request rate (req/s)", ylabel="SLO attainment (%)", ylim=(-3, 103))
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", action="append", required=True)
    parser.add_argument("--results", action="append", required=True, help="a run.sh output folder")
    parser.add_argument("--configs", default="1p1d,2c")
    parser.add_argument("--router-overhead-ms", type=float, default=0.0)
    parser.add_argument("--frontend-us-per-token", type=float, default=0.0,
                        help="front-end CPU per streamed token (benchmarks/goodput/frontend_cost.py)")
    parser.add_argument("--out", required=True, help="path prefix of the .md and .png written")
    args = parser.parse_args(argv)
    profiles = [Profile.load(p) for p in args.profile]
    rows = []
    for folder in args.results:
        rows += compare(profiles, Path(folder), args.configs.split(","), args.router_overhead_ms / 1e3,
                        args.frontend_us_per_token / 1e6)
    text = markdown(rows)
    Path(args.out + ".md").write_text(text + "\n")
    Path(args.out + ".json").write_text(json.dumps(rows, indent=1) + "\n")
    plot(rows, Path(args.out + ".png"))
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
