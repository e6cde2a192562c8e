"""What the benchmark sends: request lengths, Poisson arrival times and synthetic token-id prompts.

Every function is deterministic given its seed (numpy Generator), so two systems
benchmarked with the same seed see the same requests at the same offsets.

Workloads (`sample_lengths(workload, ...)`):

- ``fixed``: lengths from `input_len` / `output_len`, each "N" (every request N)
  or "A-B" (uniform integers in [A, B], bounds included).
- Named mixes imitate the length statistics of the datasets the DistServe paper
  (OSDI'24, §6.1) evaluated on. Each length is log-normal, given by its median
  and its spread sigma (the standard deviation of ln(length)); the mean is
  median * exp(sigma^2 / 2) and the 90th percentile median * exp(1.28 * sigma).
  Samples are rounded and clipped to at least MIN_LEN tokens.

  ========= ======================= ============ ===== ============= ===== =======================================
  mix       imitates                input median sigma output median sigma  shape
  ========= ======================= ============ ===== ============= ===== =======================================
  chat      ShareGPT (chatbot)      250          1.0   200           0.7   inputs long-tailed (p90 ~900, mean ~410),
                                                                            outputs a few hundred (mean ~255)
  code      HumanEval (code compl.) 150          0.35  120           0.45  short prompts (p90 ~235), short-tailed
                                                                            outputs (p90 ~215)
  summarize LongBench (summaries)   1500         0.5   120           0.4   long inputs (p90 ~2850), short outputs
  ========= ======================= ============ ===== ============= ===== =======================================

  These are shapes, not fits: they reproduce what makes each workload stress
  prefill or decode differently (long-prompt summarization loads prefill, chat
  loads decode), without shipping the datasets.

`max_context` clips each request so input + output <= max_context, shortening the
input first (down to MIN_LEN), then the output.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

MIN_LEN = 4
FIRST_REGULAR_TOKEN_ID = 3  # ids 0-2 are bos/eos/pad in the default model: never put them in a prompt


class LogNormal(NamedTuple):
    median: float
    sigma: float


class Mix(NamedTuple):
    input: LogNormal
    output: LogNormal


MIXES: dict[str, Mix] = {
    "chat": Mix(LogNormal(250, 1.0), LogNormal(200, 0.7)),
    "code": Mix(LogNormal(150, 0.35), LogNormal(120, 0.45)),
    "summarize": Mix(LogNormal(1500, 0.5), LogNormal(120, 0.4)),
}
MULTI_TURN = "multi-turn"  # distserve.bench.conversations: conversations, not independent requests
WORKLOADS = ("fixed", *MIXES, MULTI_TURN)


def parse_length(field: str, spec: str) -> tuple[int, int]:
    """"N" -> (N, N); "A-B" -> (A, B). Raises ValueError naming `field` unless 1 <= A <= B."""
    parts = spec.strip().split("-")
    try:
        lo, hi = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (0, -1)
    except ValueError:
        lo, hi = 0, -1
    if not 1 <= lo <= hi:
        raise ValueError(f"{field}: expected N or A-B with 1 <= A <= B, got {spec!r}")
    return lo, hi


def sample_lengths(workload: str, num: int, seed: int, input_len: str | None = None, output_len: str | None = None,
                   max_context: int | None = None) -> list[tuple[int, int]]:
    """`num` (input_len, output_len) pairs of `workload` ("fixed" or a name in MIXES); see the module docstring."""
    rng = np.random.default_rng(seed)
    if workload == "fixed":
        if input_len is None or output_len is None:
            raise ValueError("the fixed workload needs input_len and output_len")
        inputs = _uniform(rng, parse_length("input_len", input_len), num)
        outputs = _uniform(rng, parse_length("output_len", output_len), num)
    elif workload == MULTI_TURN:
        raise ValueError("workload: multi-turn requests come from distserve.bench.conversations, not lengths")
    elif workload in MIXES:
        mix = MIXES[workload]
        inputs, outputs = _log_normal(rng, mix.input, num), _log_normal(rng, mix.output, num)
    else:
        raise ValueError(f"workload: expected one of {', '.join(WORKLOADS)}, got {workload!r}")
    pairs = list(zip(inputs, outputs))
    if max_context is not None:
        if max_context < 2 * MIN_LEN:
            raise ValueError(f"max_context: must be at least {2 * MIN_LEN}, got {max_context}")
        pairs = [_fit(i, o, max_context) for i, o in pairs]
    return pairs


def _uniform(rng: np.random.Generator, bounds: tuple[int, int], num: int) -> list[int]:
    lo, hi = bounds
    return [int(x) for x in rng.integers(lo, hi + 1, size=num)]


def _log_normal(rng: np.random.Generator, dist: LogNormal, num: int) -> list[int]:
    samples = rng.lognormal(mean=math.log(dist.median), sigma=dist.sigma, size=num)
    return [max(MIN_LEN, round(float(x))) for x in samples]


def _fit(input_len: int, output_len: int, max_context: int) -> tuple[int, int]:
    input_len = min(input_len, max(max_context - output_len, min(input_len, MIN_LEN)))
    return input_len, min(output_len, max_context - input_len)


def poisson_arrivals(rate: float, num: int, seed: int) -> list[float]:
    """Arrival offsets (s) of `num` requests at `rate` per second: the first at 0.0, then exponential gaps.

    rate=inf sends everything at once (all 0.0).
    """
    if not rate > 0:
        raise ValueError(f"rate: must be > 0 (or inf), got {rate}")
    if math.isinf(rate) or num == 0:
        return [0.0] * num
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=num - 1)
    return [0.0, *(float(x) for x in np.cumsum(gaps))]


def synthetic_prompt(input_len: int, vocab_size: int, rng: np.random.Generator) -> list[int]:
    """`input_len` random token ids in [3, vocab_size): exact lengths, no tokenizer round trip."""
    if vocab_size <= FIRST_REGULAR_TOKEN_ID:
        raise ValueError(f"vocab_size: must be more than {FIRST_REGULAR_TOKEN_ID}, got {vocab_size}")
    return [int(x) for x in rng.integers(FIRST_REGULAR_TOKEN_ID, vocab_size, size=input_len)]


def synthetic_prompts(lengths: list[tuple[int, int]], vocab_size: int, seed: int, run: int = 0,
                      prefix_len: int = 0) -> list[list[int]]:
    """One prompt per (input_len, _) pair; its own random stream, so prompts do not shift the lengths.
    Each `run` (the bench gives every rate its own) draws different prompts of the same lengths, so a
    server's prefix cache cannot turn a later rate's prompts into cache hits. With `prefix_len`, every
    prompt starts with the same prefix_len tokens (a shared system prompt), also drawn per run."""
    rng = np.random.default_rng([seed, 1, run])
    prefix = synthetic_prompt(prefix_len, vocab_size, np.random.default_rng([seed, 3, run])) if prefix_len else []
    return [prefix + synthetic_prompt(input_len, vocab_size, rng) for input_len, _ in lengths]
