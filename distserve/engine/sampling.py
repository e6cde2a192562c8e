"""Sampling parameters, token sampling and the per-token finish rule.

Seeded sampling is reproducible anywhere: the random stream for the n-th
completion token depends only on (seed, n), so prefill and decode workers, or
a retry on another worker, draw the same token.

Order per token, as in vLLM: min_tokens bans -> penalties (repetition over
prompt and output, presence/frequency over output) -> greedy argmax, or
temperature -> min_p -> top-k -> top-p -> draw. With neutral penalties and
min_p 0 nothing beyond the plain sampler is computed.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from distserve.engine.structured import StructuredSpec


GREEDY_BELOW_TEMPERATURE = 1e-5


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

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

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


def _generator(seed: int, index: int) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + index) % (2**63 - 1))


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits: [V] -> logits with everything outside top-k / nucleus set to -inf."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = torch.softmax(sorted_logits, -1).cumsum(-1)
        # drop a token when the mass before it already reaches top_p (keeps at least one)
        drop_sorted = (cumulative - torch.softmax(sorted_logits, -1)) >= top_p
        logits = logits.masked_fill(torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted), float("-inf"))
    return logits


def _filter_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """logits: [V] (temperature applied) -> logits with tokens below min_p * max probability set to -inf."""
    probs = torch.softmax(logits, -1)
    return logits.masked_fill(probs < min_p * probs.max(), float("-inf"))


def apply_penalties(
    logits: torch.Tensor,
    params: SamplingParams,
    prompt_token_ids: Sequence[int] | torch.Tensor,
    output_token_ids: Sequence[int] | torch.Tensor,
) -> torch.Tensor:
    """logits [V] -> a penalised copy (the input is untouched; returned as is when nothing applies).

    Repetition penalty (HF / vLLM): for every token in the prompt or the output,
    logit / penalty if logit > 0 else logit * penalty. Presence and frequency
    (OpenAI), over the output only: logit - presence * (count > 0) - frequency * count.
    """
    if not params.has_penalties:
        return logits
    vocab_size = logits.shape[-1]
    output = torch.as_tensor(output_token_ids, dtype=torch.long, device=logits.device)
    counts = torch.bincount(output, minlength=vocab_size)  # [V] occurrences in the output
    if params.repetition_penalty != 1.0:
        prompt = torch.as_tensor(prompt_token_ids, dtype=torch.long, device=logits.device)
        seen = (counts > 0) | (torch.bincount(prompt, minlength=vocab_size) > 0)  # [V]
        penalised = torch.where(logits > 0, logits / params.repetition_penalty, logits * params.repetition_penalty)
        logits = torch.where(seen, penalised, logits)
    if params.presence_penalty != 0.0 or params.frequency_penalty != 0.0:
        counts = counts.to(logits.dtype)
        logits = logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def banned_token_ids(params: SamplingParams, eos_ids: tuple[int, ...], num_generated: int,
                     constrained: bool = False) -> list[int]:
    """Tokens that may not be drawn yet because min_tokens is not reached. None for a constrained
    (grammar) sequence: its grammar alone says when it may stop, and banning the stop tokens where they
    are all the grammar allows would leave nothing to draw."""
    if num_generated >= params.min_tokens or constrained:
        return []
    banned = list(params.stop_token_ids)
    if not params.ignore_eos:
        banned += list(eos_ids)
    return banned


def sample_token(
    logits: torch.Tensor,
    params: SamplingParams,
    index: int,
    banned: list[int],
    prompt_token_ids: Sequence[int] = (),
    output_token_ids: Sequence[int] = (),
) -> int:
    """Draws completion token number `index` (0-based) from logits [V] (float32); the input is not modified.

    prompt_token_ids and output_token_ids (the completion so far) feed the penalties; they are only
    read when a penalty is set.
    """
    if banned:
        logits = logits.clone()
        logits[banned] = float("-inf")
    if params.has_penalties:
        logits = apply_penalties(logits, params, prompt_token_ids, output_token_ids)
    if params.is_greedy:
        return int(torch.argmax(logits))
    logits = logits / params.temperature
    if params.min_p > 0.0:
        logits = _filter_min_p(logits, params.min_p)
    logits = _filter_top_k_top_p(logits, params.top_k, params.top_p)
    probs = torch.softmax(logits, -1)
    generator = _generator(params.seed if params.seed is not None else 0, index)
    return int(torch.multinomial(probs, 1, generator=generator))


def finish_reason_for(
    token: int,
    num_generated: int,
    total_len: int,
    params: SamplingParams,
    eos_ids: tuple[int, ...],
    max_context: int,
    grammar_terminated: bool = False,
) -> FinishReason | None:
    """Whether the request ends with `token`, its num_generated-th completion token.

    total_len counts prompt and completion tokens so far (including `token`). A constrained sequence
    whose grammar took a stop token (grammar_terminated) ends, even with ignore_eos.
    """
    if grammar_terminated:
        return FinishReason.STOP
    if num_generated >= params.min_tokens:
        if token in params.stop_token_ids or (not params.ignore_eos and token in eos_ids):
            return FinishReason.STOP
    if num_generated >= params.max_tokens or total_len >= max_context:
        return FinishReason.LENGTH
    return None
