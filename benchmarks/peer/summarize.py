"""Table of `vllm bench serve` results written by benchmarks/peer/compare.sh.

    python -m benchmarks.peer.summarize benchmarks/results/peer
"""

from __future__ import annotations

import json
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


def table(folder: Path) -> str:
    lines = ["| dtype | rate | system | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | output tok/s "
             "| goodput req/s | completed |", "|" + "---|" * 10]
    for dtype, rate, system, result in rows(folder):
        values = [result.get(c) for c in COLUMNS]
        cells = ["-" if v is None else f"{v:.1f}" if isinstance(v, float) else str(v) for v in values]
        lines.append(f"| {dtype} | {rate} | {system} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/peer")))
