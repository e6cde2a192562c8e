"""The soak's results: results.json (everything) and summary.md (the lines a reader wants first)."""

from __future__ import annotations

import collections
import dataclasses
import json
import statistics
from pathlib import Path

from benchmarks.soak.classify import BAD, CANCELLED, CLEAR_ERROR, COMPLETED
from benchmarks.soak.faults import KINDS, Fault

CLASSES = (COMPLETED, CLEAR_ERROR, CANCELLED, BAD)


@dataclasses.dataclass
class Judged:
    """One request after the run: its plan, outcome, class and reason."""

    index: int
    endpoint: str
    stream: bool
    action: str
    reference_key: str
    cls: str
    reason: str
    detail: str  # the error message or what was wrong, in full
    latency_s: float
    faults: list[int]  # positions in the fault list of the faults during its life
    body: dict


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def fault_rows(faults: list[Fault], judged: dict[int, Judged]) -> dict[str, dict]:
    """Per kind: how many kills, and what became of the requests in flight at them."""
    rows = {}
    for kind in KINDS:
        of_kind = [f for f in faults if f.kind == kind and f.killed_at]
        in_flight = [judged[i] for f in of_kind for i in f.in_flight if i in judged]
        by_class = collections.Counter(j.cls for j in in_flight)
        retries = [int(f.router_retries) for f in of_kind if f.router_retries is not None]
        rows[kind] = {"count": len(of_kind), "in_flight": len(in_flight),
                      **{f"in_flight_{c}": by_class[c] for c in CLASSES},
                      "router_retries": sum(retries) if retries else None,
                      "started_during_outage": sum(len(f.during) for f in of_kind),
                      "max_recovery_s": max((f.recovery_s or 0 for f in of_kind), default=None),
                      "not_recovered": sum(bool(f.error) for f in of_kind)}
    return rows


def build(args: dict, judged: list[Judged], faults: list[Fault], wall_s: float, leaks: dict,
          children: dict, log_dir: str, command: str) -> dict:
    by_index = {j.index: j for j in judged}
    completed = [j.latency_s for j in judged if j.cls == COMPLETED]
    bad = [dataclasses.asdict(j) for j in judged if j.cls == BAD]
    return {
        "command": command, "args": args, "wall_s": round(wall_s, 1), "log_dir": log_dir,
        "counts": {c: sum(j.cls == c for j in judged) for c in CLASSES},
        "reasons": {c: dict(collections.Counter(j.reason for j in judged if j.cls == c).most_common())
                    for c in CLASSES},
        "latency_completed_s": {"p50": percentile(completed, 50), "p99": percentile(completed, 99)},
        "faults": fault_rows(faults, by_index),
        "fault_log": [_fault_entry(f) for f in faults],
        "leaks": leaks, "children": children, "bad": bad[:200],
    }


def _fault_entry(fault: Fault) -> dict:
    entry = {k: v for k, v in dataclasses.asdict(fault).items() if k not in ("in_flight", "during", "killed_at")}
    return {**entry, "in_flight": len(fault.in_flight), "during": len(fault.during)}


def write(out_dir: Path, result: dict, ok: bool) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    result["ok"] = ok
    (out_dir / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    (out_dir / "summary.md").write_text(summary(result))


def summary(result: dict) -> str:
    counts, latency = result["counts"], result["latency_completed_s"]
    lines = [f"# Soak: {'PASS' if result['ok'] else 'FAIL'}", "", f"`{result['command']}`", "",
             f"{sum(counts.values())} requests in {result['wall_s']} s: " + ", ".join(f"{v} {k}" for k, v in
                                                                                   counts.items()),
             f"Completed latency p50 {_ms(latency['p50'])}, p99 {_ms(latency['p99'])}.",
             f"Leaks after recovery: {result['leaks']['leaked'] or 'none'}.", "",
             "| fault | kills | in flight | completed | clear error | cancelled | bad | router retries |"
             " max recovery s |", "|---|---|---|---|---|---|---|---|---|"]
    for kind, row in result["faults"].items():
        lines.append(f"| {kind} | {row['count']} | {row['in_flight']} | {row['in_flight_completed']} | "
                     f"{row['in_flight_clear_error']} | {row['in_flight_cancelled']} | {row['in_flight_bad']} | "
                     f"{row['router_retries']} | {_round(row['max_recovery_s'])} |")
    lines += ["", "Clear errors by kind: " + (", ".join(f"{k} ({v})" for k, v in
                                                      result["reasons"][CLEAR_ERROR].items()) or "none") + "."]
    if result["bad"]:
        lines += ["", "Bad requests (first 10):"]
        lines += [f"- #{b['index']} {b['endpoint']} stream={b['stream']}: {b['reason']}" for b in result["bad"][:10]]
    return "\n".join(lines) + "\n"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"


def _round(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"
