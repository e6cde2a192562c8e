"""What a request asks for and gets back, as the engine, the router, the gateway and the client share
it: sampling parameters, finish reasons and per-token logprobs. Torch-free, so that the router, the
gateway and the client load no tensor library (the engine's maths over these lives in
distserve.engine.sampling and distserve.engine.logprobs)."""

from __future__ import annotations

import dataclasses
import enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from distserve.engine.structured import StructuredSpec

GREEDY_BELOW_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20  # alternatives per position, as OpenAI allows


@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
    """One position: the token taken, its logprob and rank, and the top alternatives (most likely first)."""

    token_id: int
    logprob: float
    rank: int  # 1 + the number of tokens strictly more likely than token_id
    top_token_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


class FinishReason(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens; validated by the router before it reaches an engine."""

    max_tokens: int = 16
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0  # (0, 1]
    top_k: int = 0  # 0: off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    repetition_penalty: float = 1.0  # > 0; 1: off. Divides positive (multiplies negative) logits of seen tokens
    presence_penalty: float = 0.0  # [-2, 2]; subtracted once from each token already in the output
    frequency_penalty: float = 0.0  # [-2, 2]; subtracted per occurrence in the output
    min_p: float = 0.0  # [0, 1]; drop tokens less likely than min_p * the top token's probability
    logprobs: int | None = None  # return each completion token's logprob and this many alternatives
    prompt_logprobs: int | None = None  # return the prompt tokens' logprobs and this many alternatives
    structured: StructuredSpec | None = None  # a grammar the output must follow
    cache_salt: str = ""  # prefix-cache namespace: only requests with equal salts share cached KV
    # OpenAI's logit_bias: (token id, value added to its logit) pairs, sorted by token id, each id once
    # (a tuple, so the params stay hashable). Added to the raw logits before the penalties.
    logit_bias: tuple[tuple[int, float], ...] = ()

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def has_logit_bias(self) -> bool:
        return bool(self.logit_bias)

    @property
    def is_greedy(self) -> bool:
        # Below this, logits / temperature overflows to inf: sample as greedy (vLLM does the same).
        return self.temperature < GREEDY_BELOW_TEMPERATURE


def completion_params(params: SamplingParams, index: int) -> SamplingParams:
    """The params of completion `index` of n from one prompt: seeded seed + index (so n seeded
    completions differ from each other and are each reproducible); completion 0 keeps params."""
    if index == 0 or params.seed is None:
        return params
    return dataclasses.replace(params, seed=(params.seed + index) % 2**64)
