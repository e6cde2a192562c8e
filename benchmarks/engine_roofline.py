"""The engine against the hardware's limits, on this machine's cores.

    python -m benchmarks.engine_roofline --model default:small --dtype float32 --threads 1 \
        --out benchmarks/results/engine_roofline_float32.json

Measures, in one process pinned to `--threads` cores:
- memory bandwidth: reading a 1 GiB tensor (sum), best of several;
- matmul peak: a large square-ish matmul in the model dtype;
- a decode step at batch 1 (and a few larger batches): the weight-streaming roofline is
  weight bytes / bandwidth, and the step reaches roofline / step time of it. The bandwidth is the
  best of its reads, so the fraction is given for the best step too (the same measure on both
  sides), beside the median step's (this box's noise only ever adds time);
- a 512-token prefill: 2 x params x tokens (plus attention) FLOPs / time, against the matmul peak;
- prefill tokens/s against prompt length: where it stops growing is the saturation length;
- KV transfer size per prompt token, for the transfer-overlap question.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from benchmarks.results_io import write_results
from benchmarks.worker_env import reexec_like_a_worker
from distserve.engine.kv_cache import PagedKvCache, blocks_needed
from distserve.engine.model_loader import load_engine_model, resolve_model_path
from distserve.engine.model_runner import ModelRunner


def timed(fn, repeats: int, warmup: int = 2, stat=min) -> float:
    """stat (min or statistics.median) of fn's wall time over repeats, after warmup calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return stat(times)


def memory_bandwidth_gbps() -> float:
    data = torch.ones(256 * 1024 * 1024, dtype=torch.float32)  # 1 GiB
    return data.numel() * 4 / timed(data.sum, 5) / 1e9


def matmul_peak_gflops(dtype: torch.dtype) -> float:
    a, b = torch.randn(1024, 2048, dtype=dtype), torch.randn(2048, 2048, dtype=dtype)
    return 2 * 1024 * 2048 * 2048 / timed(lambda: a @ b, 5) / 1e9


def decode_batch(runner: ModelRunner, batch: int, context: int):
    """A callable running one decode step for `batch` sequences of `context` tokens each (their own
    blocks, scattered, filled with random K/V)."""
    a = runner.model.args
    per_seq = blocks_needed(context + 1, 16)
    cache = PagedKvCache(a.num_layers, a.num_kv_heads, a.head_dim, per_seq * batch, 16, runner.model.dtype,
                         runner.device)
    blocks = cache.allocator.allocate(per_seq * batch)
    random.Random(0).shuffle(blocks)  # scattered over the cache, as a server's blocks are after a while
    tables = [blocks[b * per_seq:(b + 1) * per_seq] for b in range(batch)]
    cache.fill_random_()
    return lambda: runner.decode(cache, tables, [context] * batch, [7] * batch)


def decode_step_s(runner: ModelRunner, batch: int, context: int) -> float:
    return timed(decode_batch(runner, batch, context), 20, stat=statistics.median)


def linear_sweep(runner: ModelRunner, rows_list=(1, 2, 4, 6, 8, 12, 16)) -> dict:
    """GB/s streamed through one layer's linears plus lm_head, per batch rows: our kernel against
    oneDNN's prepacked matmul (where linear.SKINNY_ROWS comes from)."""
    from distserve.engine.cpu_kernels import cpu_kernels

    kernels, w = cpu_kernels(), runner.model.weights
    linears = [*w.layers[0].linears, w.lm_head]
    num_bytes = sum(lin.num_bytes for lin in linears)
    packed = [torch.ops.mkldnn._reorder_linear_weight(lin.weight, 1) for lin in linears]
    sweep = {}
    for rows in rows_list:
        xs = [torch.randn(rows, lin.in_features, dtype=runner.model.dtype) for lin in linears]
        ours = timed(lambda: [kernels.skinny_linear(x, lin.weight) for x, lin in zip(xs, linears)], 20,
                     stat=statistics.median) if kernels is not None else float("nan")
        onednn = timed(lambda: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
                                for x, p in zip(xs, packed)], 20, stat=statistics.median)
        sweep[str(rows)] = {"ours_gbps": num_bytes / ours / 1e9, "onednn_gbps": num_bytes / onednn / 1e9}
    return sweep


def prefill_flops(runner: ModelRunner, num_tokens: int) -> float:
    """Matmul FLOPs one prompt's prefill executes: every layer's linears on every token and causal
    attention, except the last layer, which runs q/k/v on every token but attention, o-proj and MLP
    only for the last one (`model.last_layer_rows`); one lm_head row."""
    a, w = runner.model.args, runner.model.weights
    layer_params = sum(lin.in_features * lin.out_features for lin in w.layers[0].linears)
    qkv_params = w.layers[0].qkv.in_features * w.layers[0].qkv.out_features
    attention = 2 * 2 * a.num_heads * a.head_dim * num_tokens * num_tokens / 2  # QK^T and PV, causal half
    last_layer = 2 * qkv_params * num_tokens + 2 * (layer_params - qkv_params) + 2 * 2 * a.num_heads * a.head_dim * num_tokens
    return ((a.num_layers - 1) * (2 * layer_params * num_tokens + attention) + last_layer
            + 2 * w.lm_head.in_features * w.lm_head.out_features)


def main() -> None:
    reexec_like_a_worker("benchmarks.engine_roofline")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default:small")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    runner = ModelRunner(load_engine_model(resolve_model_path(args.model), args.dtype, "cpu"))
    bandwidth = memory_bandwidth_gbps()
    peak = matmul_peak_gflops(runner.model.dtype)
    weight_bytes = runner.model.weights.num_bytes
    roofline_s = weight_bytes / (bandwidth * 1e9)
    step_s = {batch: decode_step_s(runner, batch, 256) for batch in (1, 8, 32, 64)}
    best_batch1_s = timed(decode_batch(runner, 1, 256), 20)
    prompt = list(range(10, 10 + args.prefill_tokens))
    prefill_s = timed(lambda: runner.prefill([prompt]), 5, warmup=1, stat=statistics.median)
    flops = prefill_flops(runner, args.prefill_tokens)
    saturation = {}
    for length in (32, 64, 128, 256, 512, 1024):
        seconds = timed(lambda: runner.prefill([list(range(10, 10 + length))]), 3, warmup=1, stat=statistics.median)
        saturation[str(length)] = length / seconds
    a = runner.model.args
    result = {
        "model": args.model, "dtype": args.dtype, "threads": args.threads,
        "memory_bandwidth_gbps": bandwidth, "matmul_peak_gflops": peak,
        "weight_bytes_streamed_per_step": weight_bytes,
        "decode_roofline_ms": roofline_s * 1e3,
        "decode_step_ms_at_context_256": {str(b): s * 1e3 for b, s in step_s.items()},
        "decode_batch1_fraction_of_roofline": roofline_s / step_s[1],
        "decode_batch1_best_step_ms": best_batch1_s * 1e3,
        "decode_batch1_best_fraction_of_roofline": roofline_s / best_batch1_s,
        "prefill_tokens": args.prefill_tokens, "prefill_ms": prefill_s * 1e3,
        "prefill_gflops": flops / prefill_s / 1e9,
        "prefill_fraction_of_matmul_peak": flops / prefill_s / 1e9 / peak,
        "prefill_tokens_per_s_by_prompt_length": saturation,
        "linear_gbps_by_rows": linear_sweep(runner),
        "kv_bytes_per_token": 2 * a.num_layers * a.num_kv_heads * a.head_dim * runner.model.dtype.itemsize,
    }
    write_results(args.out, result)


if __name__ == "__main__":
    main()
