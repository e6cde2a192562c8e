"""Token sampling (greedy, top-k, top-p, seeds, bans) and the per-token finish rule."""

from __future__ import annotations

import math

import pytest
import torch

from distserve.engine.sampling import (
    FinishReason,
    SamplingParams,
    banned_token_ids,
    finish_reason_for,
    sample_token,
)

EOS = (1,)
GREEDY = SamplingParams(temperature=0.0)


def log_probs(*probs: float) -> torch.Tensor:
    return torch.tensor([math.log(p) for p in probs])


def draws(logits: torch.Tensor, params: SamplingParams, n: int = 300, banned: list[int] | None = None) -> set[int]:
    return {sample_token(logits, params, i, banned or []) for i in range(n)}


def test_greedy_is_argmax():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(3))
    assert sample_token(logits, GREEDY, 0, []) == int(logits.argmax())


def test_greedy_skips_banned_tokens_without_touching_the_input():
    logits = torch.tensor([0.0, 5.0, 3.0, 4.0])
    before = logits.clone()
    assert sample_token(logits, GREEDY, 0, [1, 3]) == 2
    assert torch.equal(logits, before)


def test_sampling_never_draws_a_banned_token():
    logits = torch.tensor([0.0, 10.0, 0.0, 0.0])
    assert 1 not in draws(logits, SamplingParams(seed=1), banned=[1])


def test_top_k_keeps_only_the_k_best():
    logits = torch.tensor([1.0, 4.0, 0.5, 3.0, 2.0, 0.0])
    got = draws(logits, SamplingParams(temperature=5.0, top_k=3, seed=1))
    assert got == {1, 3, 4}


def test_top_k_larger_than_vocab_is_no_filter():
    logits = torch.zeros(4)
    assert draws(logits, SamplingParams(top_k=10, seed=2)) == {0, 1, 2, 3}


@pytest.mark.parametrize("top_p, kept", [
    (0.01, {0}), (0.45, {0}), (0.7, {0, 1}), (0.9, {0, 1, 2}), (1.0, {0, 1, 2, 3}),
])
def test_top_p_keeps_the_smallest_set_reaching_the_mass(top_p, kept):
    logits = log_probs(0.5, 0.3, 0.15, 0.05)
    assert draws(logits, SamplingParams(top_p=top_p, seed=3), n=400) == kept


def test_top_p_sorts_by_probability_not_by_token_id():
    logits = log_probs(0.05, 0.15, 0.3, 0.5)
    assert draws(logits, SamplingParams(top_p=0.7, seed=4)) == {2, 3}


def test_top_k_and_top_p_combine():
    logits = log_probs(0.4, 0.3, 0.2, 0.1)
    # top_k=3 renormalises to 0.44/0.33/0.22; top_p=0.6 then keeps the first two
    assert draws(logits, SamplingParams(top_k=3, top_p=0.6, seed=5)) == {0, 1}


def test_low_temperature_sampling_concentrates_on_the_argmax():
    logits = torch.tensor([1.0, 1.5, 0.5])
    assert draws(logits, SamplingParams(temperature=1e-3, seed=6), n=50) == {1}


def test_seeded_sampling_depends_only_on_seed_and_index():
    logits = torch.zeros(1000)
    params = SamplingParams(seed=1234)
    first = [sample_token(logits, params, i, []) for i in range(20)]
    assert [sample_token(logits.clone(), params, i, []) for i in range(20)] == first
    assert sample_token(logits, params, 7, []) == first[7]  # out of order: same token
    assert len(set(first)) > 15  # indices draw independently


def test_different_seeds_draw_different_tokens():
    logits = torch.zeros(1000)
    a = [sample_token(logits, SamplingParams(seed=1), i, []) for i in range(10)]
    b = [sample_token(logits, SamplingParams(seed=2), i, []) for i in range(10)]
    assert a != b


def test_banned_token_ids_until_min_tokens():
    params = SamplingParams(min_tokens=2, stop_token_ids=(7, 8))
    assert sorted(banned_token_ids(params, EOS, 0)) == [1, 7, 8]
    assert sorted(banned_token_ids(params, EOS, 1)) == [1, 7, 8]
    assert banned_token_ids(params, EOS, 2) == []


def test_banned_token_ids_with_ignore_eos_keeps_eos_allowed():
    params = SamplingParams(min_tokens=3, stop_token_ids=(7,), ignore_eos=True)
    assert banned_token_ids(params, EOS, 0) == [7]


def test_nothing_banned_without_min_tokens():
    assert banned_token_ids(SamplingParams(stop_token_ids=(7,)), EOS, 0) == []


MAX_CONTEXT = 100


@pytest.mark.parametrize("token, num_generated, total_len, params, expected", [
    (5, 1, 10, SamplingParams(max_tokens=4), None),
    (1, 1, 10, SamplingParams(max_tokens=4), FinishReason.STOP),
    (1, 1, 10, SamplingParams(max_tokens=4, ignore_eos=True), None),
    (7, 2, 10, SamplingParams(max_tokens=4, stop_token_ids=(7,)), FinishReason.STOP),
    (7, 2, 10, SamplingParams(max_tokens=4, stop_token_ids=(7,), ignore_eos=True), FinishReason.STOP),
    (1, 2, 10, SamplingParams(max_tokens=9, min_tokens=3), None),
    (7, 2, 10, SamplingParams(max_tokens=9, min_tokens=3, stop_token_ids=(7,)), None),
    (1, 3, 10, SamplingParams(max_tokens=9, min_tokens=3), FinishReason.STOP),
    (5, 4, 10, SamplingParams(max_tokens=4), FinishReason.LENGTH),
    (1, 4, 10, SamplingParams(max_tokens=4), FinishReason.STOP),  # a stop token wins over length
    (1, 1, 10, SamplingParams(max_tokens=1, min_tokens=1, ignore_eos=True), FinishReason.LENGTH),
    (5, 1, MAX_CONTEXT, SamplingParams(max_tokens=50), FinishReason.LENGTH),
    (5, 1, MAX_CONTEXT - 1, SamplingParams(max_tokens=50), None),
], ids=["running", "eos", "ignore-eos", "stop-token", "stop-token-ignores-ignore-eos", "eos-before-min",
        "stop-token-before-min", "eos-at-min", "max-tokens", "eos-at-max-tokens", "length-with-ignore-eos",
        "context-full", "context-one-left"])
def test_finish_reason_for(token, num_generated, total_len, params, expected):
    assert finish_reason_for(token, num_generated, total_len, params, EOS, MAX_CONTEXT) is expected


def test_is_greedy():
    assert SamplingParams(temperature=0.0).is_greedy
    assert not SamplingParams(temperature=0.7).is_greedy
