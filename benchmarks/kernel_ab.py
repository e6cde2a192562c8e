"""Interleaved A/Bs of the engine's kernel choices, one process, one core.

This box's speed drifts by 30-50% within minutes, so two separate runs cannot compare kernels. Each
A/B here alternates its two arms call by call and reports the medians:

- decode step, linear layers: our small-batch kernel against oneDNN, by batch (linear.SKINNY_ROWS);
- prefill: our attention and fused kernels (silu*up, add+RMSNorm, RoPE) against SDPA and torch's ops,
  by prompt length; decode steps with the fused kernels against torch's ops, by batch;
- oneDNN weight packing: whole decode steps (batches above linear.SKINNY_ROWS) and a prefill with the
  weights packed for batch-size hint 1 against linear.PACK_BATCH_HINT;
- whole prefills, attention: our compiled kernel against SDPA's CPU flash kernel, bf16 and float32 (the
  engine picks ours in bf16 only where the CPU lacks AMX: attention.prefill_kernel), by prompt length;
- decode steps, attention: our tiled paged kernels (bf16 and float32 on AVX-512, float32 on AVX2)
  against the generic one, by batch and context;
- decode steps, whole layers: csrc/decode_layer.cpp (one C++ call a layer) against the Python layer, by
  batch, up to the rows our small-batch matmul takes (linear.SKINNY_ROWS);
- sampling a temperature-1 batch: batched inverse-CDF draws against torch.multinomial per row.

    python -m benchmarks.kernel_ab --out benchmarks/results/kernel_ab.json
    python -m benchmarks.kernel_ab --only decode_attention --out benchmarks/results/kernel_ab_decode_attention.json
    python -m benchmarks.kernel_ab --only linear_pack_hint --only prefill_attention --out benchmarks/results/kernel_ab_amx.json
    python -m benchmarks.kernel_ab --only decode_linear --only decode_layer --out benchmarks/results/kernel_ab_decode_small_batch.json
    python -m benchmarks.kernel_ab --dtype float32 --only decode_linear --only decode_attention --only decode_layer \
        --only prefill_attention --out benchmarks/results/epyc_avx2/kernel_ab_float32.json   # an AVX2-only CPU
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from benchmarks.engine_roofline import decode_batch
from benchmarks.results_io import write_results
from benchmarks.worker_env import reexec_like_a_worker
from distserve.engine import attention
from distserve.engine.dtype import cpu_has_amx
from distserve.engine.linear import PACK_BATCH_HINT
from distserve.engine.model_loader import load_engine_model, resolve_model_path
from distserve.engine.model_runner import ModelRunner
from distserve.engine.sampling import SampleRow, sample_tokens
from distserve.request_types import SamplingParams


def interleaved(arms: dict, repeats: int = 10) -> dict[str, float]:
    """Median ms of each arm: {name: (set_up, call)}; set_up() switches to the arm, call() is timed."""
    times: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(repeats):
        for name, (set_up, call) in arms.items():
            set_up()
            call()  # once untimed: the switch's first call may pack weights or warm caches
            started = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - started)
    return {name: round(statistics.median(t) * 1e3, 2) for name, t in times.items()}


def decode_linear_ab(model: str, dtype: str) -> dict:
    runner = ModelRunner(load_engine_model(resolve_model_path(model), dtype, "cpu"))
    linears = runner.model.weights.linears
    chosen = [lin._skinny_rows for lin in linears]  # the engine's own limits (on AVX2 the lm_head's is higher)

    def rows_limit(limit: int | None):
        return lambda: [setattr(lin, "_skinny_rows", chosen[i] if limit is None else limit)
                        for i, lin in enumerate(linears)]

    results = {}
    for batch in (1, 2, 3, 4, 6, 8, 12, 16):
        step = decode_batch(runner, batch, 256)
        results[str(batch)] = interleaved({"onednn_ms": (rows_limit(0), step), "ours_ms": (rows_limit(99), step),
                                           "engine_ms": (rows_limit(None), step)})
    rows_limit(None)()
    return {"dtype": dtype, "ours_used_up_to_rows": chosen[0], "lm_head_up_to_rows": chosen[-1],
            "decode_step_by_batch": results}


def prefill_ab(model: str, dtype: str) -> dict:
    runner = ModelRunner(load_engine_model(resolve_model_path(model), dtype, "cpu"))
    model = runner.model
    kernel_choice, silu_mul, small_ops = attention.prefill_kernel, model.fused_silu_mul, model.fused_small_ops

    def use(ours: bool):
        def set_up():
            attention.prefill_kernel = kernel_choice if ours else (lambda q: None)
            model.fused_silu_mul, model.fused_small_ops = (silu_mul, small_ops) if ours else (None, None)
        return set_up

    results = {}
    for length in (256, 1024):
        prompt = list(range(10, 10 + length))
        prefill = lambda: runner.prefill([prompt])  # noqa: E731
        results[str(length)] = interleaved({"torch_ms": (use(False), prefill), "ours_ms": (use(True), prefill)}, 6)
    decode = {}
    for batch in (1, 8, 32):
        step = decode_batch(runner, batch, 256)
        decode[str(batch)] = interleaved({"torch_ms": (use(False), step), "ours_ms": (use(True), step)})
    use(True)()
    return {"dtype": dtype, "prefill_by_prompt_length": results, "decode_step_by_batch": decode}


def linear_pack_hint_ab(model: str, dtype: str) -> dict:
    runner = ModelRunner(load_engine_model(resolve_model_path(model), dtype, "cpu"))
    linears = runner.model.weights.linears
    packed = {hint: [torch.ops.mkldnn._reorder_linear_weight(lin.weight, hint) for lin in linears]
              for hint in (1, PACK_BATCH_HINT)}

    def use(hint: int):
        return lambda: [setattr(lin, "_packed", weight) for lin, weight in zip(linears, packed[hint])]

    def arms(call):
        return {"hint_1_ms": (use(1), call), f"hint_{PACK_BATCH_HINT}_ms": (use(PACK_BATCH_HINT), call)}

    decode = {str(batch): interleaved(arms(decode_batch(runner, batch, 256))) for batch in (8, 32, 64)}
    prompt = list(range(10, 266))
    prefill = interleaved(arms(lambda: runner.prefill([prompt])), 6)
    use(PACK_BATCH_HINT)()
    return {"dtype": dtype, "decode_step_by_batch": decode, "prefill_256_tokens": prefill}


def prefill_attention_ab(model: str, dtype: str) -> dict:
    """Whole prefills: our compiled attention against SDPA, everything else as the engine runs it."""
    runner = ModelRunner(load_engine_model(resolve_model_path(model), dtype, "cpu"))
    kernel_choice = attention.prefill_kernel

    def use(choice):
        return lambda: setattr(attention, "prefill_kernel", choice)

    results = {}
    for length in (256, 512, 1024):
        prompt = list(range(10, 10 + length))
        prefill = lambda: runner.prefill([prompt])  # noqa: E731
        results[str(length)] = interleaved({"sdpa_ms": (use(lambda q: None), prefill),
                                            "ours_ms": (use(attention.compiled_prefill_kernel), prefill)}, 6)
    use(kernel_choice)()
    return {"dtype": dtype, "cpu_has_amx": cpu_has_amx(), "engine_uses_ours": kernel_choice(
        torch.empty(1, 1, runner.model.args.head_dim, dtype=runner.model.dtype)) is not None,
        "prefill_by_prompt_length": results}


def decode_attention_ab(model: str, dtype: str) -> dict:
    """Decode steps: our tiled paged attention (AVX-512; AVX2 in float32) against the generic compiled kernel."""
    runner = ModelRunner(load_engine_model(resolve_model_path(model), dtype, "cpu"))
    kernel_choice = attention.compiled_decode_kernel

    def use(ours: bool):
        return lambda: setattr(attention, "compiled_decode_kernel", kernel_choice if ours else (lambda cache: None))

    results = {}
    for batch, context in ((1, 256), (8, 256), (32, 256), (64, 256), (8, 2048)):
        step = decode_batch(runner, batch, context)
        results[f"{batch}x{context}"] = interleaved({"generic_ms": (use(False), step), "ours_ms": (use(True), step)})
    use(True)()
    return {"dtype": dtype, "decode_step_by_batch_x_context": results}


def sampling_ab(vocab: int = 32000) -> dict:
    results = {}
    for batch in (6, 50):
        logits = torch.randn(batch, vocab)
        rows = [SampleRow(SamplingParams(seed=b), 3) for b in range(batch)]

        def per_row_multinomial():
            for b in range(batch):
                generator = torch.Generator().manual_seed(b)
                torch.multinomial(torch.softmax(logits[b], -1), 1, generator=generator)

        results[str(batch)] = interleaved({"multinomial_per_row_ms": (lambda: None, per_row_multinomial),
                                           "batched_ms": (lambda: None, lambda: sample_tokens(logits, rows))})
    return {"vocab": vocab, "temperature_1_by_batch": results}


def decode_layer_ab(model: str, dtype: str) -> dict:
    runner = ModelRunner(load_engine_model(resolve_model_path(model), dtype, "cpu"))
    compiled = runner.model.compiled_decode_layer

    def use(layer_op):
        return lambda: setattr(runner.model, "compiled_decode_layer", layer_op)

    results = {}
    for batch in (1, 2, 4, 8, 16):
        if not runner.model.weights.layers[0].qkv.runs_own_kernel(batch):
            break
        step = decode_batch(runner, batch, 256)
        results[str(batch)] = interleaved({"python_ms": (use(None), step), "compiled_ms": (use(compiled), step)})
    use(compiled)()
    return {"dtype": dtype, "compiled_layer_available": compiled is not None, "decode_step_by_batch": results}


SECTIONS = {  # name -> section(model, dtypes)
    "decode_linear": lambda model, dtypes: [decode_linear_ab(model, dtype) for dtype in dtypes],
    "prefill_kernels": lambda model, dtypes: [prefill_ab(model, dtype) for dtype in dtypes],
    "linear_pack_hint": lambda model, dtypes: [linear_pack_hint_ab(model, dtype) for dtype in dtypes],
    "prefill_attention": lambda model, dtypes: [prefill_attention_ab(model, dtype) for dtype in dtypes],
    "decode_attention": lambda model, dtypes: [decode_attention_ab(model, dtype) for dtype in dtypes],
    "decode_layer": lambda model, dtypes: [decode_layer_ab(model, dtype) for dtype in dtypes],
    "sampling": lambda model, dtypes: sampling_ab(),
}


def main() -> None:
    reexec_like_a_worker("benchmarks.kernel_ab")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default:small")
    parser.add_argument("--only", choices=sorted(SECTIONS), action="append", help="run these sections (default: all)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), action="append",
                        help="the dtypes of the per-dtype sections (default: both)")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = {"model": args.model, "threads": 1, "command": " ".join(["python -m benchmarks.kernel_ab", *sys.argv[1:]])}
    for name in args.only or SECTIONS:
        result[name] = SECTIONS[name](args.model, args.dtype or ("bfloat16", "float32"))
    write_results(args.out, result)


if __name__ == "__main__":
    main()
