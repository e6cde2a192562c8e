"""What a JSON-schema grammar costs per decode step, next to the decode step itself.

    python -m benchmarks.structured_overhead --out benchmarks/results/structured_overhead.json

For batch 1 and 16, every row follows the same JSON schema (bounded fields, so sequences finish and
restart at a fresh state, covering the whole grammar). Random logits [B, V] go through
distserve.engine.structured.mask_logits (one bitmask: fill per row, apply once), a token is drawn per
row, and each row's state accepts it. Timed separately: the mask (fill + apply) per step, and accept
per token. Then one decode step of the same model at the same batch (context 256), as
benchmarks.engine_roofline measures it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from benchmarks.engine_roofline import decode_step_s
from benchmarks.results_io import write_results
from distserve.engine.model_loader import load_engine_model, resolve_model_path
from distserve.engine.model_runner import ModelRunner
from distserve.engine.structured import GrammarCompiler, StructuredSpec, mask_logits

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "tags", "active"],
}


def grammar_step_costs(compiler: GrammarCompiler, batch: int, steps: int, vocab_size: int) -> dict:
    """Median seconds per step of mask_logits at this batch, and per token of accept."""
    spec = StructuredSpec("json_schema", json.dumps(SCHEMA))
    states = [compiler.matcher(spec) for _ in range(batch)]
    generator = torch.Generator().manual_seed(0)
    mask_s, accept_s, finished = [], [], 0
    for _ in range(steps):
        logits = torch.randn(batch, vocab_size, generator=generator) * 3  # [B, V]
        started = time.perf_counter()
        mask_logits(logits, states)
        mask_s.append(time.perf_counter() - started)
        tokens = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator).flatten().tolist()
        started = time.perf_counter()
        for state, token in zip(states, tokens):
            state.accept(token)
        accept_s.append((time.perf_counter() - started) / batch)
        for i, state in enumerate(states):
            if state.is_terminated:
                states[i] = compiler.matcher(spec)
                finished += 1
    return {"mask_ms_per_step": statistics.median(mask_s) * 1e3,
            "mask_us_per_token": statistics.median(mask_s) / batch * 1e6,
            "mask_ms_per_step_p90": statistics.quantiles(mask_s, n=10)[-1] * 1e3,
            "accept_us_per_token": statistics.median(accept_s) * 1e6,
            "sequences_finished": finished}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default:small")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--out", default="benchmarks/results/structured_overhead.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    path = resolve_model_path(args.model)
    runner = ModelRunner(load_engine_model(path, "float32", "cpu"))
    vocab_size = runner.model.weights.lm_head.out_features
    tokenizer = AutoTokenizer.from_pretrained(path)
    compiler = GrammarCompiler(tokenizer, vocab_size, (tokenizer.eos_token_id,))
    started = time.perf_counter()
    compiler.check(StructuredSpec("json_schema", json.dumps(SCHEMA)))
    compile_ms = (time.perf_counter() - started) * 1e3
    by_batch = {}
    for batch in (1, 16):
        costs = grammar_step_costs(compiler, batch, args.steps, vocab_size)
        step_ms = decode_step_s(runner, batch, 256) * 1e3
        grammar_ms = costs["mask_ms_per_step"] + costs["accept_us_per_token"] * batch / 1e3
        by_batch[str(batch)] = {**costs, "decode_step_ms": step_ms,
                                "grammar_fraction_of_decode_step": grammar_ms / step_ms}
    write_results(args.out, {
        "model": args.model, "vocab_size": vocab_size, "threads": args.threads, "steps": args.steps,
        "schema": SCHEMA, "compile_ms": compile_ms, "by_batch": by_batch,
        "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
    })


if __name__ == "__main__":
    main()
