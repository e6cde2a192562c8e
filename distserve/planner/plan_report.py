"""What `distserve plan` prints and writes: the ranked fleets and per-rate simulations."""

from __future__ import annotations

import math

from distserve.planner.fleet_spec import describe_workers
from distserve.planner.placement import DeviceBudget
from distserve.planner.profile import Profile
from distserve.planner.search import Ranked, replicas_to_fill
from distserve.planner.sim_metrics import SimSummary


def _ms(seconds: float) -> str:
    return "-" if not math.isfinite(seconds) else f"{seconds * 1e3:.0f}"


def _pct(fraction: float) -> str:
    return "-" if math.isnan(fraction) else f"{fraction * 100:.1f}%"


def describe_profile(profile: Profile) -> str:
    unit = "GPU" if profile.device.startswith("cuda") else "core"
    size = f"{profile.cores_per_worker} {unit}{'s' if profile.cores_per_worker > 1 else ''}"
    simulated = " SIMULATED" if profile.host.startswith("SIMULATED") else ""
    return f"{size}: {profile.model} {profile.dtype} {profile.device}{simulated}"


def latency_line(summary: SimSummary) -> str:
    return (f"attainment {_pct(summary.attainment)}, TTFT p50/p90/p99 {_ms(summary.ttft_p50_s)}/"
            f"{_ms(summary.ttft_p90_s)}/{_ms(summary.ttft_p99_s)} ms, TPOT p50/p90/p99 "
            f"{_ms(summary.tpot_p50_s)}/{_ms(summary.tpot_p90_s)}/{_ms(summary.tpot_p99_s)} ms")


def format_best(best: Ranked, budget: DeviceBudget, rate: float | None, at_rate: SimSummary | None) -> str:
    devices = best.candidate.config.devices
    lines = [f"Best: {describe_workers(best.candidate.config.workers, budget.unit)}",
             f"  fleet {best.candidate.fleet}, {devices} {budget.unit}{'s' if devices > 1 else ''}, "
             f"placement: {best.candidate.placement}",
             f"  predicted goodput {best.goodput.rate:.3g} req/s, {best.per_device:.3g} req/s per {budget.unit}"]
    copies = replicas_to_fill(best, budget)
    if copies > 1:
        lines.append(f"  uses {devices} of {budget.total} {budget.unit}s: run {copies} copies "
                     f"(about {copies * best.goodput.rate:.3g} req/s)")
    if at_rate is not None:
        lines.append(f"  at {rate:g} req/s: {latency_line(at_rate)}")
    return "\n".join(lines)


def format_table(ranked: list[Ranked], budget: DeviceBudget, rate: float | None,
                 at_rate: dict[int, SimSummary]) -> str:
    unit = budget.unit
    header = ["rank", "fleet", "family", unit + "s", "goodput/s", f"per {unit}", "placement"]
    if rate is not None:
        header.append(f"attain@{rate:g}/s")
    rows = [header]
    for i, r in enumerate(ranked, 1):
        row = [str(i), r.candidate.fleet, r.candidate.family, str(r.candidate.config.devices),
               f"{r.goodput.rate:.3g}", f"{r.per_device:.3g}", r.candidate.placement]
        if rate is not None:
            row.append(_pct(at_rate[i - 1].attainment) if i - 1 in at_rate else "-")
        rows.append(row)
    widths = [max(len(row[k]) for row in rows) for k in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


FAMILY_ADVICE = {"disaggregated": "disaggregate", "colocated": "colocate", "mixed": "mix (prefill + decode + colocated)"}
PAST_KNEE = 1.2  # where a fleet's misses are read: this many times its goodput


def misses_past_knee(results, slo) -> tuple[float, float]:
    """Shares of requests missing TTFT and TPOT (from simulate(...).results just past a fleet's goodput)."""
    num = max(len(results), 1)
    return (sum(r.ttft_s > slo.ttft_s for r in results) / num, sum(r.tpot_s > slo.tpot_s for r in results) / num)


def _why(misses: tuple[float, float]) -> str:
    ttft, tpot = misses
    if not ttft and not tpot:
        return "misses neither target there (its goodput is the search's upper bound)"
    if ttft >= tpot:
        return f"TTFT binds ({ttft:.0%} miss it, {tpot:.0%} TPOT): prompts queue for prefill"
    return f"TPOT binds ({tpot:.0%} miss it, {ttft:.0%} TTFT): decode steps are slow or stalled by prompts"


def format_recommendation(best_by_family: dict, misses: dict, unit: str) -> str:
    """Which kind of fleet to run, each family's best with its predicted goodput per device, and why: the
    SLO each one misses first past its goodput. `best_by_family`: family -> its best Ranked, in the
    search's order (its objective: the first is the best); `misses`: family -> misses_past_knee."""
    ordered = list(best_by_family.items())
    (family, best), rest = ordered[0], ordered[1:]
    lines = [f"Recommendation: {FAMILY_ADVICE[family]}: {best.candidate.fleet}, "
             f"{best.goodput.rate:.3g} req/s ({best.per_device:.3g} per {unit}) predicted"]
    for other_family, other in rest:
        ratio = f" ({other.per_device / best.per_device:.2f}x per {unit})" if best.per_device else ""
        lines.append(f"  instead: {FAMILY_ADVICE[other_family]}: {other.candidate.fleet}, {other.goodput.rate:.3g} "
                     f"req/s ({other.per_device:.3g} per {unit}){ratio}")
    lines.append(f"  why, each just past its goodput ({PAST_KNEE:g}x):")
    lines += [f"    {f}: {_why(misses[f])}" for f, _ in ordered if f in misses]
    return "\n".join(lines)


def format_simulation(fleet: str, summaries: dict[float, SimSummary]) -> str:
    lines = [f"Simulated fleet {fleet}:"]
    for rate, summary in summaries.items():
        lines.append(f"  {rate:g} req/s: {latency_line(summary)}, {summary.num_served}/{summary.num_requests} "
                     f"served, e2e p50/p99 {_ms(summary.e2e_p50_s)}/{_ms(summary.e2e_p99_s)} ms")
    return "\n".join(lines)
