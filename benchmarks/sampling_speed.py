"""What one call of distserve.engine.sampling.sample_tokens costs per decode step, by batch size.

    python -m benchmarks.sampling_speed --out benchmarks/results/sampling_speed.json

Random logits [B, V] (float32, vocabulary 32000 by default) and B seeded rows at temperature 0.8 with no
penalties or filters: the common sampled case. The decode worker samples on its own single core, so
torch runs one thread unless --threads says otherwise. Each step draws the next completion index, as a
decode step does; the first calls are not timed. Runs under the workers' malloc settings (their big
buffers come back without page faults). Reports the median, p10 and p90 milliseconds per call and the
median microseconds per row.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.results_io import write_results
from benchmarks.worker_env import reexec_like_a_worker
from distserve.engine.sampling import SampleRow, sample_tokens
from distserve.request_types import SamplingParams

TEMPERATURE = 0.8
WARMUP_STEPS = 5


def step_seconds(batch: int, vocab: int, steps: int) -> list[float]:
    """Seconds of each timed sample_tokens call on logits [batch, vocab]."""
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(batch)) * 3  # [B, V]
    params = [SamplingParams(temperature=TEMPERATURE, seed=row) for row in range(batch)]
    seconds = []
    for step in range(WARMUP_STEPS + steps):
        rows = [SampleRow(row_params, step) for row_params in params]
        started = time.perf_counter()
        sample_tokens(logits, rows)
        if step >= WARMUP_STEPS:
            seconds.append(time.perf_counter() - started)
    return seconds


def summary(seconds: list[float], batch: int) -> dict:
    deciles = statistics.quantiles(seconds, n=10)
    median = statistics.median(seconds)
    return {"median_ms": round(median * 1e3, 3), "p10_ms": round(deciles[0] * 1e3, 3),
            "p90_ms": round(deciles[-1] * 1e3, 3), "median_us_per_row": round(median / batch * 1e6, 2)}


def main() -> None:
    reexec_like_a_worker("benchmarks.sampling_speed")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=50, help="timed calls per batch size")
    parser.add_argument("--out", default="benchmarks/results/sampling_speed.json", help='"" writes no file')
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    by_batch = {str(batch): summary(step_seconds(batch, args.vocab, args.steps), batch) for batch in args.batches}
    write_results(args.out, {
        "vocab": args.vocab, "threads": args.threads, "temperature": TEMPERATURE, "steps": args.steps,
        "torch": torch.__version__, "by_batch": by_batch, "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
    })


if __name__ == "__main__":
    main()
