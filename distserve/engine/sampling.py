"""Sampling parameters, token sampling and the per-token finish rule.

Seeded sampling is reproducible anywhere: the random stream for the n-th
completion token depends only on (seed, n), so prefill and decode workers, or
a retry on another worker, draw the same token.

Order per token, as in vLLM: min_tokens bans -> logit_bias -> penalties
(repetition over prompt and output, presence/frequency over output) -> greedy
argmax, or temperature -> min_p -> top-k -> top-p -> draw. With no bans, no
logit_bias, neutral penalties and min_p 0 nothing beyond the plain sampler is
computed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

from distserve.engine.cpu_kernels import cpu_kernels_with
from distserve.request_types import FinishReason, SamplingParams

DRAW_BLOCK = 256  # tokens per block of the two-level draw (see _draw)
ROWS_PER_PASS = 4  # rows whose exp and block sums run together: 4 x 32k float32 = 512 KiB stays in L2
_MASK64 = 2**64 - 1


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


class SampleRow(NamedTuple):
    """What one row of a batch needs to draw its token."""

    params: SamplingParams
    index: int  # which completion token this is (0-based): with the seed, it fixes the draw
    banned: Sequence[int] = ()  # tokens that may not be drawn (banned_token_ids)
    prompt_token_ids: Sequence[int] = ()  # read only when a penalty is set
    output_token_ids: Sequence[int] = ()  # the completion so far; read only when a penalty is set


def sample_token(
    logits: torch.Tensor,
    params: SamplingParams,
    index: int,
    banned: Sequence[int],
    prompt_token_ids: Sequence[int] = (),
    output_token_ids: Sequence[int] = (),
) -> int:
    """Draws completion token number `index` (0-based) from logits [V] (float32); the input is not modified.

    prompt_token_ids and output_token_ids (the completion so far) feed the penalties; they are only
    read when a penalty is set. One row of `sample_tokens`, so a token drawn alone equals the token
    drawn for the same row in any batch. Raises the row's error (e.g. non-finite probabilities).
    """
    token = sample_tokens(logits[None], [SampleRow(params, index, banned, prompt_token_ids, output_token_ids)])[0]
    if isinstance(token, Exception):
        raise token
    return token


def sample_tokens(logits: torch.Tensor, rows: Sequence[SampleRow]) -> list[int | Exception]:
    """A token per row of logits [B, V] (float32; not modified), or the error that row's draw raised.

    Rows are batched where it pays: one argmax for the greedy rows, and one temperature, exp and
    inverse-CDF draw for the sampled ones. Bans, logit biases, penalties and filters are per row and
    computed only for rows that set them. Each row's result depends only on its own logits and SampleRow.
    """
    tokens: list[int | Exception] = [0] * len(rows)
    adjusted = {b: _adjusted(logits[b], row) for b, row in enumerate(rows)
                if _adjusts_logits(row)}  # row -> its own adjusted copy [V]
    greedy = [b for b, row in enumerate(rows) if row.params.is_greedy]
    if greedy:
        for b, token in zip(greedy, logits[greedy].argmax(-1).tolist()):
            tokens[b] = int(adjusted[b].argmax()) if b in adjusted else token
    sampled = [b for b, row in enumerate(rows) if not row.params.is_greedy]
    if sampled:
        order, weights, block_sums = _sampled_weights(logits, rows, sampled, adjusted)  # [S, V], [S, num_blocks]
        uniforms = [_uniform(rows[b].params.seed if rows[b].params.seed is not None else 0, rows[b].index)
                    for b in order]
        for b, token in zip(order, _draw(weights, block_sums, uniforms)):
            tokens[b] = token
    return tokens


def _sampled_weights(logits: torch.Tensor, rows: Sequence[SampleRow], sampled: list[int],
                     adjusted: dict[int, torch.Tensor]) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """The draw's inputs for the sampled rows: (their order in the result, weights [S, V], block sums
    [S, num_blocks]), as `_weights(_scaled(...))` defines them.

    On CPU with the compiled kernel (csrc/sampling_weights.cpp: two passes per row instead of torch's
    five), a plain row (temperature only) is read straight from the logits and scaled by 1 / T there;
    a row with its own adjusted copy or a filter is scaled and filtered by `_scaled` first. Which way
    a row goes depends on its own parameters alone, so a row's token never depends on its batch.
    """
    kernels = cpu_kernels_with(logits, "sampling_weights_f32") if logits.dtype == torch.float32 else None
    if kernels is None:
        return sampled, *_weights(_scaled(logits, rows, sampled, adjusted))
    block = _block_size(logits.shape[1])
    plain = [b for b in sampled if b not in adjusted and _is_plain(rows[b].params)]
    filtered = [b for b in sampled if b in adjusted or not _is_plain(rows[b].params)]
    parts = []  # (weights, block sums) per group, plain rows first
    if plain:
        scales = torch.tensor([1.0 / rows[b].params.temperature for b in plain], dtype=torch.float32)
        parts.append(kernels.sampling_weights_f32(logits, torch.tensor(plain), scales, block))
    if filtered:
        scaled = _scaled(logits, rows, filtered, adjusted)  # [F, V], temperature already applied
        parts.append(kernels.sampling_weights_f32(scaled, torch.arange(len(filtered)), torch.ones(len(filtered)), block))
    if len(parts) == 1:
        return sampled, *parts[0]  # one group: all of `sampled`, in its order
    weights, sums = zip(*parts)
    return plain + filtered, torch.cat(weights), torch.cat(sums)


def _is_plain(params: SamplingParams) -> bool:
    """Temperature only: no min_p, top-k or top-p filter (bans, biases and penalties live in `adjusted`)."""
    return params.min_p <= 0.0 and not 0 < params.top_k and params.top_p >= 1.0


def _adjusts_logits(row: SampleRow) -> bool:
    """Whether the row needs its own copy of its logits: it bans tokens, biases them or penalises them.
    Rows that do none of these (the common case) are read straight from the batch's logits."""
    return bool(row.banned) or row.params.has_logit_bias or row.params.has_penalties


def _adjusted(logits: torch.Tensor, row: SampleRow) -> torch.Tensor:
    """logits [V] -> a copy with the row's banned tokens at -inf, its logit bias added and its penalties
    applied, in that order. A banned or grammar-masked token (-inf) stays -inf whatever its bias."""
    logits = logits.clone()
    if row.banned:
        logits[list(row.banned)] = float("-inf")
    if row.params.has_logit_bias:
        ids, values = zip(*row.params.logit_bias)
        logits.index_add_(0, torch.tensor(ids, device=logits.device),
                          torch.tensor(values, dtype=logits.dtype, device=logits.device))
    return apply_penalties(logits, row.params, row.prompt_token_ids, row.output_token_ids)


def _scaled(logits: torch.Tensor, rows: Sequence[SampleRow], sampled: list[int],
            adjusted: dict[int, torch.Tensor]) -> torch.Tensor:
    """The sampled rows' logits [S, V], a new tensor: adjusted where the row has its own copy, divided
    by the row's temperature, then min_p / top-k / top-p filtered (filtered tokens at -inf)."""
    temperatures = torch.tensor([[rows[b].params.temperature] for b in sampled], dtype=logits.dtype,
                                device=logits.device)  # [S, 1]
    chosen = logits if len(sampled) == len(rows) else logits.index_select(
        0, torch.tensor(sampled, device=logits.device))
    scaled = chosen / temperatures  # [S, V]
    for s, b in enumerate(sampled):
        if b in adjusted:
            scaled[s] = adjusted[b] / temperatures[s]
    for s, b in enumerate(sampled):
        params = rows[b].params
        if params.min_p > 0.0:
            scaled[s] = _filter_min_p(scaled[s], params.min_p)
        if 0 < params.top_k < scaled.shape[-1] or params.top_p < 1.0:
            scaled[s] = _filter_top_k_top_p(scaled[s], params.top_k, params.top_p)
    return scaled


def _weights(scaled: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """scaled logits [S, V] -> (weights [S, V], their block sums [S, num_blocks] float64); the weights are
    the unnormalised probabilities exp(scaled - row max), computed in place.

    No softmax: the draw scales its target by the row's total, so normalising would be a wasted pass.
    The row's top token weighs exactly 1, so a finite row's total is in [1, V]. A row with a NaN,
    +inf or only -inf gets NaN weights, which _draw reports as that row's error. ROWS_PER_PASS rows at
    a time, so that the max, exp and sum passes find them in cache: at batch 64 x 32k vocab on one core
    here, ~3 ms instead of ~5 for all rows at once. Each row's numbers do not depend on its chunk.
    """
    sums = []
    for rows in scaled.split(ROWS_PER_PASS):  # [<= ROWS_PER_PASS, V] views
        rows.sub_(rows.amax(-1, keepdim=True)).exp_()
        sums.append(_block_sums(rows))
    return scaled, torch.cat(sums) if len(sums) > 1 else sums[0]


def _block_size(vocab: int) -> int:
    return min(DRAW_BLOCK, vocab)


def _block_sums(weights: torch.Tensor) -> torch.Tensor:
    """weights [S, V] -> sums of each block of _block_size(V) tokens [S, ceil(V / block)], accumulated in float64."""
    vocab = weights.shape[1]
    block = _block_size(vocab)
    num_full = vocab // block
    sums = weights[:, :num_full * block].unflatten(-1, (num_full, block)).sum(-1, dtype=torch.float64)
    if vocab % block:  # a short last block
        sums = torch.cat([sums, weights[:, num_full * block:].sum(-1, keepdim=True, dtype=torch.float64)], -1)
    return sums


def _splitmix64(state: int, n: int) -> int:
    """Output number n (0-based) of SplitMix64 started at `state`: a 64-bit integer."""
    z = (state + (n + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _uniform(seed: int, index: int) -> float:
    """The draw's uniform number in [0, 1): the one rule from (seed, index) to randomness.

    Output `index` of SplitMix64 started at a hash of the seed (so nearby seeds do not share a stream),
    top 53 bits: a multiple of 2**-53, at most 1 - 2**-53. Times a float64 total >= 1 it stays strictly
    below the total (the exact product is below by total * 2**-53, at least half the total's ulp; where
    exactly half, at a power of two, the product is representable), so `_draw` never falls off the end.
    """
    return (_splitmix64(_splitmix64(seed & _MASK64, 0), index) >> 11) * 2.0**-53


def _draw(weights: torch.Tensor, block_sums: torch.Tensor, uniforms: list[float]) -> list[int | Exception]:
    """Inverse-CDF draw: row s takes the first token whose running weight sum exceeds uniforms[s] times
    the row's total. weights: [S, V] unnormalised, >= 0; block_sums: _block_sums(weights).

    Why not torch.multinomial: on CPU it costs ~0.85 ms per 32k-vocab row (exponential_ ~0.75 ms).
    Why two levels: a float64 cumsum of all of [S, V] cost more than the rest of sampling together.
    Instead the running sum over the block sums picks the block, and a float64 cumsum of that one block
    picks the token: the same token as a full float64 cumsum, up to float64 rounding. A token of weight
    0 is never drawn: the search takes the first running sum strictly above the target, and a zero
    weight does not raise it.
    """
    block = _block_size(weights.shape[1])
    cdf = torch.nn.functional.pad(block_sums, (1, 0)).cumsum(-1)  # [S, num_blocks + 1], from 0
    totals = cdf[:, -1:]  # [S, 1]
    targets = totals * torch.tensor([[u] for u in uniforms], dtype=torch.float64, device=cdf.device)  # [S, 1]
    # block k holds the target: cdf[k] <= target < cdf[k + 1] (the clamps matter only to failing rows)
    blocks = torch.searchsorted(cdf, targets, right=True).sub_(1).clamp_(0, cdf.shape[1] - 2)  # [S, 1]
    positions = torch.arange(block, device=cdf.device).add(blocks, alpha=block)  # [S, block]: its tokens
    inner_cdf = _gather(weights, positions).cumsum(-1, dtype=torch.float64)  # [S, block]
    # The block's own cumsum may round a hair below its block sum: keep the target strictly below the
    # block's last rise (the factor takes at least one ulp off), which a token of positive weight makes.
    inner_targets = torch.minimum(targets - cdf.gather(1, blocks), inner_cdf[:, -1:] * (1.0 - 2.0**-52))
    offsets = torch.searchsorted(inner_cdf, inner_targets, right=True).clamp_(max=block - 1)  # [S, 1]
    return [token if math.isfinite(total) and total > 0.0 else
            ValueError(f"cannot sample: the probabilities are not finite or sum to {total}")
            for (token,), (total,) in zip(positions.gather(1, offsets).tolist(), totals.tolist())]


def _gather(weights: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """weights [S, V] at positions [S, block]; positions past the vocabulary (a short last block) weigh 0."""
    vocab = weights.shape[1]
    if vocab % positions.shape[1] == 0:
        return weights.gather(1, positions)
    return weights.gather(1, positions.clamp(max=vocab - 1)).masked_fill_(positions >= vocab, 0.0)


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
