"""The SLO map: which fleet serves most requests per second within each set of targets, measured.

    python -m benchmarks.slo_map CELL_DIR [CELL_DIR ...] [--out benchmarks/results/slo_map]

Each CELL_DIR is one workload (prompt and output length) that benchmarks/goodput/run.sh drove against
every fleet (CELL_DIR/<fleet>/results.json, with --repeats). Nothing is run again: every request's
TTFT, TPOT and longest stall are in results.json, so each run is re-judged against a grid of targets
fixed here before any cell was measured (TTFT from loose to tight, then TPOT, then the longest gap
between two chunks of a stream). Goodput is read off each repeat's attainment curve as `distserve
bench` reads it (90%, linear between rates; 0 when the lowest rate misses; the highest rate, a lower
bound, when none misses). A fleet wins a cell decisively when its lowest repeat beats every other
fleet's highest. Writes slo_map.json, slo_map.md and slo_map.png.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from distserve.bench.stats import ATTAINMENT_TARGET, goodput, meets, rate_from_json

# (label, TTFT ms, TPOT ms, longest stall ms or None), loose to tight; the same grid for every cell
TARGETS = [
    ("loose", 4000, 200, None),
    ("ttft 2s", 2000, 100, None),
    ("ttft 1s", 1000, 100, None),
    ("ttft 0.5s", 500, 100, None),
    ("tpot 50ms", 4000, 50, None),
    ("tpot 25ms", 4000, 25, None),
    ("stall 300ms", 4000, 100, 300),
    ("stall 150ms", 4000, 100, 150),
    ("stall 75ms", 4000, 100, 75),
]
DISAGGREGATED = ("1p1d-nospill", "1p1d")
BASELINE = "2c"


def repeat_goodputs(results: dict, ttft_ms: float, tpot_ms: float, stall_ms: float | None) -> list[float]:
    """Goodput (req/s) of each repeat of one fleet's run against these targets."""
    per_repeat = results["workload"]["num_prompts"]
    rates = [rate_from_json(r["rate"]) for r in results["rates"]]
    num_repeats = len(results["rates"][0]["requests"]) // per_repeat
    goodputs = []
    for repeat in range(num_repeats):
        attained = []
        for rate in results["rates"]:
            records = rate["requests"][repeat * per_repeat:(repeat + 1) * per_repeat]
            met = sum(meets(r, ttft_ms / 1e3, tpot_ms / 1e3, None, None if stall_ms is None else stall_ms / 1e3)
                      for r in records)
            attained.append(met / len(records))
        goodputs.append(goodput(rates, attained, ATTAINMENT_TARGET).rps)
    return goodputs


def judge_cell(cell: Path) -> dict:
    fleets = {path.parent.name: json.loads(path.read_text()) for path in sorted(cell.glob("*/results.json"))}
    workload = next(iter(fleets.values()))["workload"]
    rows = []
    for label, ttft, tpot, stall in TARGETS:
        each = {name: repeat_goodputs(results, ttft, tpot, stall) for name, results in fleets.items()}
        median = {name: statistics.median(values) for name, values in each.items()}
        best = max(median.values())
        leaders = [name for name, value in median.items() if value == best]
        winner = leaders[0] if len(leaders) == 1 else None  # a tie (often all at the highest rate: bounds)
        decisive = winner is not None and all(min(each[winner]) > max(values) for name, values in each.items()
                                              if name != winner)
        split = max((median[n] for n in DISAGGREGATED if n in median), default=0.0)
        base = median.get(BASELINE, 0.0)
        rows.append({"targets": label, "ttft_ms": ttft, "tpot_ms": tpot, "stall_ms": stall, "goodput": each,
                     "median": median, "winner": winner, "decisive": decisive,
                     "disaggregated_over_2c": (split / base) if base else None})
    return {"cell": cell.name, "input_len": workload.get("input_len"), "output_len": workload.get("output_len"),
            "fleets": list(fleets), "rows": rows}


def markdown(cells: list[dict]) -> str:
    lines = ["# SLO map: goodput per fleet and target set, measured on this box", "",
             "Goodput in req/s at 90% attainment, median of the repeats (lowest-highest). Winner in bold (none on "
             "a tie), `!` when decisive (its lowest repeat beats every other fleet's highest). A fleet that met "
             "every rate scores the highest rate: a lower bound. Last column: the best disaggregated fleet (1p1d, "
             "with or without spilling) over 2 colocated workers.", ""]
    for cell in cells:
        lines += [f"## {cell['cell']}: prompts {cell['input_len']}, outputs {cell['output_len']}", "",
                  "| targets | " + " | ".join(cell["fleets"]) + " | disagg / 2c |",
                  "|---|" + "---|" * (len(cell["fleets"]) + 1)]
        for row in cell["rows"]:
            cells_text = []
            for name in cell["fleets"]:
                values = row["goodput"][name]
                text = f"{row['median'][name]:.2f} ({min(values):.2f}-{max(values):.2f})"
                if name == row["winner"]:
                    text = f"**{text}**" + (" !" if row["decisive"] else "")
                cells_text.append(text)
            ratio = row["disaggregated_over_2c"]
            lines.append(f"| {row['targets']} | " + " | ".join(cells_text) + f" | {'-' if ratio is None else f'{ratio:.2f}x'} |")
        lines.append("")
    lines += ["Targets: " + "; ".join(f"{label}: TTFT {t} ms, TPOT {p} ms" + (f", stall {s} ms" if s else "")
                                      for label, t, p, s in TARGETS), ""]
    return "\n".join(lines)


def chart(cells: list[dict], path: Path) -> None:
    """One panel: a row per cell, a column per target set; the winner's colour, the disagg / 2c ratio."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted({name for cell in cells for name in cell["fleets"]})
    colours = {name: plt.cm.tab10(i) for i, name in enumerate(names)}
    fig, ax = plt.subplots(figsize=(1.3 * len(TARGETS) + 2, 0.9 * len(cells) + 1.8))
    for y, cell in enumerate(cells):
        for x, row in enumerate(cell["rows"]):
            colour = colours[row["winner"]] if row["winner"] else "lightgrey"
            ax.add_patch(plt.Rectangle((x, y), 1, 1, color=colour, alpha=0.9 if row["decisive"] else 0.4))
            ratio = row["disaggregated_over_2c"]
            ax.text(x + 0.5, y + 0.5, "-" if ratio is None else f"{ratio:.2f}x", ha="center", va="center", fontsize=8)
    ax.set_xlim(0, len(TARGETS))
    ax.set_ylim(0, len(cells))
    ax.set_xticks([i + 0.5 for i in range(len(TARGETS))], [label for label, *_ in TARGETS], rotation=30, ha="right")
    ax.set_yticks([i + 0.5 for i in range(len(cells))], [f"{c['input_len']}/{c['output_len']}" for c in cells])
    ax.set_title("Winner per cell (colour; faint: spreads overlap; grey: a tie), text: best 1p1d / 2c")
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=colours[n]) for n in names], labels=names,
              loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=len(names), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("cells", nargs="+")
    parser.add_argument("--out", default="benchmarks/results/slo_map")
    args = parser.parse_args()
    cells = [judge_cell(Path(cell)) for cell in args.cells]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "slo_map.json").write_text(json.dumps({"targets": TARGETS, "cells": cells}, indent=1) + "\n")
    text = markdown(cells)
    (out / "slo_map.md").write_text(text)
    chart(cells, out / "slo_map.png")
    print(text)


if __name__ == "__main__":
    main()
