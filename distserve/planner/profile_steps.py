"""Times forward steps of the real engine, the samples the step-time model is fitted to.

Every step goes through `ModelRunner` as the workers call it, under torch.inference_mode, and its
time is the median of `repeats` runs after one warm-up run of the same shape. The runs go in
rounds over all shapes (shape 1, 2, ..., then again), so that a burst of other work on the
machine spoils one run of many shapes, which the median drops, rather than every run of one:
- prefill (`prefill_chunks`): one packed batch of prompt chunks. A chunk at position p > 0 first
  has its prompt's earlier p tokens prefilled (untimed) into its KV buffer, as a chunked prompt has;
- decode (`decode`): B sequences of one context length in a PagedKvCache;
- mixed (`step`): prompt chunks and decoding sequences in one fused forward, as a colocated
  worker runs them.
Re-running a shape is idempotent (a chunk rewrites its own KV positions, a decode step its own
slot), so repeats measure the same work.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import statistics
import time
from typing import Callable

import torch

from distserve.engine.kv_cache import PagedKvCache, blocks_needed
from distserve.engine.model_runner import DecodeWork, ModelRunner, PrefillWork
from distserve.planner.profile import StepSample, StepShape

log = logging.getLogger(__name__)

PREFILL_TOKENS = (16, 32, 64, 128, 256, 512, 1024, 2048)
PROMPTS_PER_BATCH = (1, 4, 16)  # equal-length prompts sharing a step: attn_work varies apart from tokens
MIN_PROMPT_TOKENS = 16  # shorter prompts in a many-prompt batch would be unlike real traffic
POSITIONED_CHUNKS = ((128, 128), (128, 896), (256, 768), (512, 1536))  # (length, position)
DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64)
DECODE_CONTEXTS = (64, 256, 1024)
MIXED_CHUNKS = (128, 256)
MIXED_BATCHES = (4, 16)
MIXED_CONTEXT = 256

QUICK_PREFILL_TOKENS = (16, 64)
QUICK_PROMPTS_PER_BATCH = (1, 4)
QUICK_MIN_PROMPT_TOKENS = 4
QUICK_POSITIONED_CHUNKS = ((16, 32),)
QUICK_DECODE_BATCHES = (1, 4)
QUICK_DECODE_CONTEXTS = (16, 64)
QUICK_MIXED = ((16,), (2,), 32)  # chunk lengths, batches, context


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """The step shapes to time, by group."""

    prefill: tuple[StepShape, ...]
    decode: tuple[StepShape, ...]
    mixed: tuple[StepShape, ...]


def step_plan(quick: bool, max_tokens: int, max_context: int) -> StepPlan:
    """Shapes whose packed tokens stay within max_tokens and whose prompts fit max_context."""
    cap = min(max_tokens, max_context)
    sizes, counts, min_length = ((QUICK_PREFILL_TOKENS, QUICK_PROMPTS_PER_BATCH, QUICK_MIN_PROMPT_TOKENS) if quick
                                 else (PREFILL_TOKENS, PROMPTS_PER_BATCH, MIN_PROMPT_TOKENS))
    prefill = [StepShape(chunks=((total // k, 0),) * k) for total in sizes if total <= cap for k in counts
               if total % k == 0 and (k == 1 or total // k >= min_length)]
    positioned = QUICK_POSITIONED_CHUNKS if quick else POSITIONED_CHUNKS
    prefill += [StepShape(chunks=((n, p),)) for n, p in positioned if n <= max_tokens and n + p <= max_context]
    batches, contexts = (QUICK_DECODE_BATCHES, QUICK_DECODE_CONTEXTS) if quick else (DECODE_BATCHES, DECODE_CONTEXTS)
    decode = [StepShape(decode_contexts=(ctx,) * b) for ctx in contexts if ctx < max_context for b in batches]
    chunks, mixed_batches, ctx = QUICK_MIXED if quick else (MIXED_CHUNKS, MIXED_BATCHES, MIXED_CONTEXT)
    mixed = [StepShape(chunks=((n, 0),), decode_contexts=(ctx,) * b)
             for n in chunks if n <= cap and ctx < max_context for b in mixed_batches]
    return StepPlan(tuple(prefill), tuple(decode), tuple(mixed))


def measure_steps(runner: ModelRunner, shapes: list[StepShape], repeats: int,
                  block_size: int = 16) -> list[StepSample]:
    """Times every shape (see the module docstring)."""
    a = runner.model.args
    num_blocks = max([sum(blocks_needed(c + 1, block_size) for c in s.decode_contexts) for s in shapes] + [1])
    cache = PagedKvCache(a.num_layers, a.num_kv_heads, a.head_dim, num_blocks, block_size, runner.model.dtype,
                         runner.device)
    cache.fill_random_()
    tokens = random.Random(0)
    with torch.inference_mode():
        steps = [_prepare_step(runner, cache, shape, lambda n: [tokens.randrange(a.vocab_size) for _ in range(n)])
                 for shape in shapes]
        times: list[list[float]] = [[] for _ in shapes]
        for round_ in range(repeats + 1):  # round 0 warms up
            for step, shape_times in zip(steps, times):
                started = time.perf_counter()
                step()
                if round_:
                    shape_times.append(time.perf_counter() - started)
            log.info("round %d of %d done", round_, repeats)
    return [StepSample(shape, statistics.median(t)) for shape, t in zip(shapes, times)]


def _prepare_step(runner: ModelRunner, cache: PagedKvCache, shape: StepShape,
                  token_ids: Callable[[int], list[int]]) -> Callable[[], object]:
    """Builds the step's inputs (prefilling positioned chunks' prefixes) and returns the call that
    runs it. Shapes are timed one at a time, so each lays its sequences over the whole cache."""
    works = []
    for length, position in shape.chunks:
        kv = runner.new_kv_buffer(position + length)
        if position:
            runner.prefill_chunks([PrefillWork(token_ids(position), 0, kv, True)])
        works.append(PrefillWork(token_ids(length), position, kv, True))
    if not shape.decode_contexts:
        return lambda: runner.prefill_chunks(works)
    contexts = list(shape.decode_contexts)
    # Scattered over the cache, as a server's blocks are after a while: attention reads them slower
    # than blocks in order (the hardware prefetcher does not follow a block table).
    scattered = list(range(cache.allocator.num_blocks))
    random.Random(len(contexts)).shuffle(scattered)
    tables, start = [], 0
    for context in contexts:
        tables.append(scattered[start:start + blocks_needed(context + 1, cache.block_size)])
        start += len(tables[-1])
    input_ids = token_ids(len(contexts))
    if not works:
        return lambda: runner.decode(cache, tables, contexts, input_ids)
    decode = DecodeWork(cache, tables, contexts, input_ids)
    return lambda: runner.step(works, decode)
