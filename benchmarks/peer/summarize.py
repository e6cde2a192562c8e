"""Table of `vllm bench serve` results written by benchmarks/peer/compare.sh.

    python -m benchmarks.peer.summarize benchmarks/results/peer

A folder of rounds (round1, round2, ...) gives each round's table, then one of every metric's median
over the rounds.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

COLUMNS = ["median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "output_throughput",
           "request_goodput", "completed"]


def rows(folder: Path) -> list[tuple[str, str, str, dict]]:
    found = []
    for path in sorted(folder.glob("*_rate*.json")):
        system, dtype, rate = path.stem.split("_")
        found.append((dtype, rate.removeprefix("rate"), system, json.loads(path.read_text())))
    return sorted(found, key=lambda r: (r[0], r[1], r[2] != "vllm"))


def _median(values: list) -> float | int:
    """The median; of counts (ints), the lower middle one, so that a count stays a count."""
    if all(isinstance(v, int) for v in values):
        return statistics.median_low(values)
    return statistics.median(values)


def median_rows(rounds: list[Path]) -> list[tuple[str, str, str, dict]]:
    """One row per (dtype, rate, system) found in every round: each metric's median over the rounds."""
    by_key: dict[tuple[str, str, str], list[dict]] = {}
    for folder in rounds:
        for dtype, rate, system, result in rows(folder):
            by_key.setdefault((dtype, rate, system), []).append(result)
    merged = []
    for key, results in by_key.items():
        if len(results) == len(rounds):
            merged.append((*key, {c: _median([r[c] for r in results]) for c in COLUMNS
                                  if all(r.get(c) is not None for r in results)}))
    return sorted(merged, key=lambda r: (r[0], r[1], r[2] != "vllm"))


def table(found: list[tuple[str, str, str, dict]]) -> str:
    lines = ["| dtype | rate | system | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | output tok/s "
             "| goodput req/s | completed |", "|" + "---|" * 10]
    for dtype, rate, system, result in found:
        values = [result.get(c) for c in COLUMNS]
        cells = ["-" if v is None else f"{v:.1f}" if isinstance(v, float) else str(v) for v in values]
        lines.append(f"| {dtype} | {rate} | {system} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary(folder: Path) -> str:
    rounds = sorted((p for p in folder.glob("round*") if p.is_dir()), key=lambda p: int(p.name[5:]))
    if not rounds:
        return table(rows(folder))
    parts = [f"### {r.name}\n\n{table(rows(r))}" for r in rounds]
    parts.append(f"### median of {len(rounds)} rounds\n\n{table(median_rows(rounds))}")
    return "\n\n".join(parts)


if __name__ == "__main__":
    print(summary(Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/peer")))
