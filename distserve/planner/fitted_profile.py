"""Profiles from the DistServe paper's own latency model, so our simulator can run on its inputs.

DistServe's simulator (github.com/LLMServe/DistServe, simdistserve/estimators/time_estimator.py and
base/worker.py) times a step, in milliseconds, from least-squares fits on A100s:

    prefill step (prompts of lengths l_i):      a_p + b_p * sum(l_i) + c_p * sum(l_i^2) + 1
    decode step (B sequences of contexts c_i):  a_d + b_d * sum(c_i + 1) + c_d * B
    every step also:                            2 + 1e-4 * (context tokens in the step)

with the decode coefficients switching from a small- to a large-batch fit at B = 95. `FittedProfile`
is that model in our Profile's terms: sum(l_i^2) is twice the causal pairs whole prompts attend
(`chunk_attn_pairs`) less their tokens, exact for whole prompts; a later chunk (n tokens at p) is charged
2np + 2n^2 - n where its share of the whole prompt's square is 2np + n^2, so chunked prefill pays up to
~25% more on that term than the paper's model would (a few % of a step). A mixed (chunked-prefill) step, which the paper's model never times, is costed
as its prefill part plus the decode part's per-token and per-sequence terms (one step constant): an
assumption of ours, stated wherever it is used.
"""

from __future__ import annotations

import dataclasses

from distserve.planner.profile import Profile, StepShape

PREFILL_PP_CONST_MS = 1.0  # time_estimator.get_prefill_time: `pp_const = 1 * pp`, pp = 1
STEP_OVERHEAD_MS = 2.0  # worker.add_ray_overhead: base
STEP_OVERHEAD_MS_PER_TOKEN = 1e-4  # worker.add_ray_overhead: per context token


@dataclasses.dataclass(frozen=True)
class StepFit:
    """One engine's fitted coefficients at one tensor-parallel degree, each (a, b, c) in ms."""

    prefill: tuple[float, float, float]
    decode_small_batch: tuple[float, float, float]
    decode_large_batch: tuple[float, float, float]
    large_batch_from: int = 95

    def prefill_ms(self, tokens: int, squares: float) -> float:
        a, b, c = self.prefill
        return a + b * tokens + c * squares + PREFILL_PP_CONST_MS

    def decode_ms(self, num_decode: int, context: int, with_constant: bool = True) -> float:
        a, b, c = self.decode_small_batch if num_decode < self.large_batch_from else self.decode_large_batch
        return (a if with_constant else 0.0) + b * (context + num_decode) + c * num_decode


@dataclasses.dataclass
class FittedProfile(Profile):
    """A Profile timed by a StepFit (see the module docstring). In memory only, like RooflineProfile."""

    fit: StepFit | None = None

    def step_time(self, shape: StepShape) -> float:
        return self.step_time_from_totals(shape.num_tokens - len(shape.decode_contexts), shape.prompt_attn,
                                          len(shape.decode_contexts), sum(shape.decode_contexts))

    def step_time_from_totals(self, prompt_tokens: int, prompt_attn: int, num_decode: int,
                              decode_context: int) -> float:
        ms = 0.0
        if prompt_tokens:
            # sum(l^2) of whole prompts: chunk_attn_pairs counts l * (l + 1) / 2 pairs for each
            ms += self.fit.prefill_ms(prompt_tokens, 2 * prompt_attn - prompt_tokens)
        if num_decode:
            ms += self.fit.decode_ms(num_decode, decode_context, with_constant=not prompt_tokens)
        ms += STEP_OVERHEAD_MS + STEP_OVERHEAD_MS_PER_TOKEN * (prompt_tokens + decode_context)
        return ms / 1e3


def fitted_profile(name: str, fit: StepFit, gpus: int, kv_capacity_tokens: int, kv_bytes_per_token: int,
                   max_batch_tokens: int, source: str) -> FittedProfile:
    """A worker of `gpus` GPUs timed by `fit`. KV transfers are free, as in DistServe's simulator."""
    return FittedProfile(
        model=name, dtype="float16", device="cuda", cores_per_worker=gpus, kv_bytes_per_token=kv_bytes_per_token,
        kv_capacity_tokens=kv_capacity_tokens, max_batch_tokens=max_batch_tokens, step_coeffs=(0.0,) * 5,
        transfer_latency_s=0.0, transfer_bytes_per_s=float("inf"), host=f"FITTED (not measured here): {source}",
        fit=fit)
