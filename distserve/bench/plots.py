"""Charts of results.json documents (matplotlib, Agg canvas: no display, no pyplot global state).

- attainment.png: SLO attainment (%) against request rate, one curve per run,
  the 90% target line, and each run's goodput marked on it.
- latency_cdf.png: CDFs of TTFT and TPOT (two panels), one curve per rate.

Rate inf has no place on a linear axis: it is drawn one step right of the
highest finite rate and labelled "inf".
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from distserve.bench.stats import ATTAINMENT_TARGET, attainment_spread, rate_from_json


def _inf_position(runs: list[dict[str, Any]]) -> float:
    finite = [r for run in runs for r in map(rate_from_json, (x["rate"] for x in run["rates"])) if math.isfinite(r)]
    return 1.25 * max(finite) if finite else 1.0


def _save(fig: Figure, path: Path | str) -> None:
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=120, bbox_inches="tight")


def plot_attainment(runs: list[dict[str, Any]], path: Path | str) -> None:
    """One attainment curve per results.json document in `runs`, with its goodput marked."""
    fig = Figure(figsize=(7, 4.5))
    ax = fig.add_subplot()
    inf_x = _inf_position(runs)
    ticks: dict[float, str] = {}
    for run in runs:
        rates = [rate_from_json(r["rate"]) for r in run["rates"]]
        xs = [inf_x if math.isinf(r) else r for r in rates]
        ticks.update({x: "inf" if math.isinf(r) else f"{r:g}" for x, r in zip(xs, rates)})
        points = sorted(zip(xs, (100 * r["attainment"] for r in run["rates"]),
                            (attainment_spread(r) for r in run["rates"])))
        (line,) = ax.plot([x for x, _, _ in points], [y for _, y, _ in points], marker="o", label=run["label"])
        if any("repeats" in r for r in run["rates"]):  # error bars: the lowest and highest repeat
            ax.errorbar([x for x, _, _ in points], [y for _, y, _ in points],
                        yerr=[[y - 100 * low for _, y, (low, _) in points], [100 * high - y for _, y, (_, high) in points]],
                        fmt="none", ecolor=line.get_color(), capsize=3)
        bound = ">= " if run["goodput_is_lower_bound"] else ""
        ax.axvline(run["goodput_rps"], color=line.get_color(), linestyle=":", linewidth=1)
        ax.plot([run["goodput_rps"]], [100 * ATTAINMENT_TARGET], marker="*", markersize=12, color=line.get_color(),
                linestyle="none", clip_on=False, label=f"{run['label']} goodput {bound}{run['goodput_rps']:.2f} req/s")
    ax.axhline(100 * ATTAINMENT_TARGET, color="grey", linestyle="--", linewidth=1)
    ax.set_xticks(list(ticks), list(ticks.values()))
    ax.set_xlim(left=0)
    ax.set_ylim(0, 105)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("SLO attainment (%)")
    if runs:
        slo = runs[0]["slo"]
        ax.set_title(f"SLO attainment (TTFT <= {slo['ttft_ms']:g} ms and TPOT <= {slo['tpot_ms']:g} ms)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    _save(fig, path)


def plot_latency_cdf(run: dict[str, Any], path: Path | str) -> None:
    """TTFT and TPOT CDFs (ms) of one run's successful requests, one curve per rate, the SLOs as lines."""
    fig = Figure(figsize=(11, 4.2))
    panels = zip(fig.subplots(1, 2), ("ttft_s", "tpot_s"), ("TTFT", "TPOT"), ("ttft_ms", "tpot_ms"))
    for ax, key, name, slo_key in panels:
        for rate in run["rates"]:
            values = sorted(1000 * r[key] for r in rate["requests"] if r["ok"] and r[key] is not None)
            if values:
                fractions = [i / len(values) for i in range(len(values) + 1)]  # from 0 at the fastest request
                ax.step([values[0], *values], fractions, where="post", label=f"rate {rate_from_json(rate['rate']):g}")
        ax.axvline(run["slo"][slo_key], color="grey", linestyle="--", linewidth=1, label="SLO")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.set_title(f"{name} CDF — {run['label']}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    _save(fig, path)
