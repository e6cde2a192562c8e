"""A prefill worker's forwards beside a decode worker's, on two cores, without the rest of the system.

    python -m benchmarks.core_turns_pair --dtype bfloat16 --seconds 8 \
        --out benchmarks/results/core_turns_pair.json

Two processes, as the workers would run: one prefills a 256-token prompt every 250 ms (4 req/s), the
other runs decode steps back to back (batch 8, context 256). Each layout in turn:
- split: one core each (the default 1+1 split);
- turns: both cores each, taking turns (distserve.engine.core_turns, as with `--take-turns`);
- shared: both cores each, no turns (they contend);
- prefill-alone-1 / prefill-alone-2: the prefill process alone on one or both cores (no decode).
Reports the median wait for a turn, median and mean forward time per process.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import tempfile
import time

from benchmarks.results_io import write_results

PROMPT_TOKENS, PREFILL_EVERY_S, DECODE_BATCH, DECODE_CONTEXT = 256, 0.25, 8, 256
LAYOUTS = {  # name: (prefill cores, decode cores or None, take turns)
    "split": ([0], [1], False),
    "turns": ([0, 1], [0, 1], True),
    "shared": ([0, 1], [0, 1], False),
    "prefill-alone-1": ([0], None, False),
    "prefill-alone-2": ([0, 1], None, False),
}


def worker(kind: str, cores: list[int], turns_dir: str, dtype: str, seconds: float, results, go) -> None:
    os.sched_setaffinity(0, cores)
    import torch

    torch.set_num_threads(len(cores))
    from benchmarks.engine_roofline import decode_batch
    from distserve.engine.core_turns import core_turns
    from distserve.engine.model_loader import load_engine_model, resolve_model_path
    from distserve.engine.model_runner import ModelRunner, PrefillWork

    runner = ModelRunner(load_engine_model(resolve_model_path("default:small"), dtype, "cpu"))
    runner.warm_up()
    turns = core_turns(turns_dir)
    prompt, kv = list(range(10, 10 + PROMPT_TOKENS)), runner.new_kv_buffer(PROMPT_TOKENS)
    step = decode_batch(runner, DECODE_BATCH, DECODE_CONTEXT)
    results.put("ready")
    go.wait()
    waits, runs = [], []
    end = next_prompt = time.perf_counter()
    end += seconds
    while time.perf_counter() < end:
        if kind == "prefill":
            time.sleep(max(0.0, next_prompt - time.perf_counter()))
            next_prompt += PREFILL_EVERY_S
        asked = time.perf_counter()
        with turns.turn():
            started = time.perf_counter()
            if kind == "prefill":
                runner.prefill_chunks([PrefillWork(prompt, 0, kv, True)])
            else:
                step()
            ended = time.perf_counter()
        waits.append(started - asked)
        runs.append(ended - started)
    results.put((kind, {"count": len(runs), "wait_p50_ms": statistics.median(waits) * 1e3,
                        "run_p50_ms": statistics.median(runs) * 1e3, "run_mean_ms": statistics.mean(runs) * 1e3}))


def run_layout(name: str, dtype: str, seconds: float) -> dict:
    prefill_cores, decode_cores, take_turns = LAYOUTS[name]
    context = multiprocessing.get_context("spawn")
    go, results = context.Event(), context.Queue()
    turns_dir = tempfile.mkdtemp(prefix="core-turns-") if take_turns else ""
    kinds = [("prefill", prefill_cores)] + ([("decode", decode_cores)] if decode_cores else [])
    processes = [context.Process(target=worker, args=(kind, cores, turns_dir, dtype, seconds, results, go))
                 for kind, cores in kinds]
    for process in processes:
        process.start()
    for _ in processes:
        results.get()
    go.set()
    measured = dict(results.get() for _ in processes)
    for process in processes:
        process.join()
    return measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated, from: " + ", ".join(LAYOUTS))
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    result = {"dtype": args.dtype, "seconds": args.seconds,
              "layouts": {name: run_layout(name, args.dtype, args.seconds) for name in args.layouts.split(",")}}
    write_results(args.out, result)


if __name__ == "__main__":
    main()
