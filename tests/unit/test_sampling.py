"""Token sampling (greedy, top-k, top-p, min_p, penalties, seeds, bans) and the per-token finish rule."""

from __future__ import annotations

import collections
import dataclasses
import math
import statistics

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from distserve.engine import sampling
from distserve.engine.sampling import SampleRow, apply_penalties, banned_token_ids, finish_reason_for, sample_token
from distserve.request_types import FinishReason, SamplingParams

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


# --- min_p ---------------------------------------------------------------------


@pytest.mark.parametrize("min_p, kept", [
    (0.0, {0, 1, 2, 3}), (0.05, {0, 1, 2, 3}), (0.35, {0, 1}), (0.5, {0, 1}), (0.7, {0}), (1.0, {0}),
])
def test_min_p_drops_tokens_below_a_fraction_of_the_top_probability(min_p, kept):
    logits = log_probs(0.5, 0.3, 0.15, 0.05)  # thresholds: min_p * 0.5
    assert draws(logits, SamplingParams(min_p=min_p, seed=7), n=400) == kept


def test_min_p_applies_after_temperature():
    # at temperature 2 the probabilities are ~0.379, 0.293, 0.208, 0.120: min_p 0.5 keeps those >= 0.189
    logits = log_probs(0.5, 0.3, 0.15, 0.05)
    assert draws(logits, SamplingParams(temperature=2.0, min_p=0.5, seed=8), n=400) == {0, 1, 2}


def test_min_p_does_not_change_greedy():
    logits = torch.tensor([0.0, 3.0, 2.9])
    assert sample_token(logits, SamplingParams(temperature=0.0, min_p=0.99), 0, []) == 1


# --- penalties -----------------------------------------------------------------

SMALL_LOGITS = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0])
SMALL_PROMPT = [0, 1]
SMALL_OUTPUT = [3, 3, 2]


@pytest.mark.parametrize("params, expected", [
    # repetition 2 on tokens 0-3 (prompt or output): positive / 2, negative * 2; token 4 never seen
    (SamplingParams(repetition_penalty=2.0), [1.0, -2.0, 0.25, 1.5, -2.0]),
    (SamplingParams(repetition_penalty=0.5), [4.0, -0.5, 1.0, 6.0, -2.0]),
    # presence 0.5 once per output token (2, 3), frequency 0.25 per occurrence (3 twice, 2 once); prompt ignored
    (SamplingParams(presence_penalty=0.5), [2.0, -1.0, 0.0, 2.5, -2.0]),
    (SamplingParams(frequency_penalty=0.25), [2.0, -1.0, 0.25, 2.5, -2.0]),
    (SamplingParams(frequency_penalty=-1.0), [2.0, -1.0, 1.5, 5.0, -2.0]),
    (SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25),
     [1.0, -2.0, -0.5, 0.5, -2.0]),
], ids=["repetition", "repetition-below-one", "presence", "frequency", "negative-frequency", "all"])
def test_penalties_against_hand_computed_logits(params, expected):
    before = SMALL_LOGITS.clone()
    got = apply_penalties(SMALL_LOGITS, params, SMALL_PROMPT, SMALL_OUTPUT)
    assert torch.allclose(got, torch.tensor(expected))
    assert torch.equal(SMALL_LOGITS, before)  # the input is not modified


@pytest.mark.parametrize("penalty", [0.7, 1.3, 2.0])
def test_repetition_penalty_matches_transformers(penalty):
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(200, generator=gen) * 3
    prompt = torch.randint(0, 200, (40,), generator=gen).tolist()
    output = torch.randint(0, 200, (25,), generator=gen).tolist()
    expected = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([prompt + output]), logits[None].clone())[0]
    got = apply_penalties(logits, SamplingParams(repetition_penalty=penalty), prompt, output)
    assert torch.allclose(got, expected)
    assert not torch.equal(got, logits)


def test_presence_and_frequency_follow_the_openai_formula():
    gen = torch.Generator().manual_seed(12)
    logits = torch.randn(100, generator=gen)
    prompt = torch.randint(0, 100, (30,), generator=gen).tolist()
    output = torch.randint(0, 20, (60,), generator=gen).tolist()  # many repeats
    params = SamplingParams(presence_penalty=0.7, frequency_penalty=-0.3)
    expected = logits.clone()
    for token, count in collections.Counter(output).items():
        expected[token] -= params.presence_penalty + params.frequency_penalty * count
    assert torch.allclose(apply_penalties(logits, params, prompt, output), expected)


def test_penalties_accept_tensors_and_keep_the_dtype():
    logits = SMALL_LOGITS.to(torch.bfloat16)
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    got = apply_penalties(logits, params, torch.tensor(SMALL_PROMPT), torch.tensor(SMALL_OUTPUT))
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, apply_penalties(logits, params, SMALL_PROMPT, SMALL_OUTPUT))
    assert torch.equal(got.float(), torch.tensor([1.0, -2.0, -0.5, 0.5, -2.0]))


def test_neutral_params_compute_nothing_extra(monkeypatch):
    def fail(*args):
        raise AssertionError("penalties computed with neutral params")

    logits = torch.randn(50, generator=torch.Generator().manual_seed(13))
    assert apply_penalties(logits, SamplingParams(), [1, 2], [3]) is logits
    monkeypatch.setattr(sampling, "apply_penalties", fail)
    monkeypatch.setattr(sampling, "_filter_min_p", fail)
    assert not SamplingParams().has_penalties
    # token ids outside the vocabulary would fail if they were read
    assert sample_token(logits, GREEDY, 0, [], [10**6], [10**6]) == int(logits.argmax())
    assert sample_token(logits, SamplingParams(seed=3), 4, [], [10**6], [10**6]) == \
        sample_token(logits, SamplingParams(seed=3), 4, [])


@pytest.mark.parametrize("params", [
    SamplingParams(repetition_penalty=1.1), SamplingParams(presence_penalty=-0.1),
    SamplingParams(frequency_penalty=2.0),
])
def test_has_penalties(params):
    assert params.has_penalties


def test_penalties_change_greedy_output():
    assert sample_token(SMALL_LOGITS, GREEDY, 0, []) == 3
    params = dataclasses.replace(GREEDY, repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    assert sample_token(SMALL_LOGITS, params, 3, [], SMALL_PROMPT, SMALL_OUTPUT) == 0
    # repetition covers the prompt too: output token 3 falls to 1.5, and prompt token 0 from 2.0 to 1.0
    repetition = dataclasses.replace(GREEDY, repetition_penalty=2.0)
    assert sample_token(SMALL_LOGITS, repetition, 3, [], [], SMALL_OUTPUT) == 0
    assert sample_token(SMALL_LOGITS, repetition, 3, [], SMALL_PROMPT, SMALL_OUTPUT) == 3


def test_a_strong_frequency_penalty_stops_sampling_repeats():
    logits = torch.zeros(4)
    params = SamplingParams(frequency_penalty=2.0, seed=14)
    assert draws(logits, params) == {0, 1, 2, 3}
    assert {sample_token(logits, params, i, [], [], [0] * 10 + [2] * 10) for i in range(300)} == {1, 3}


def test_penalties_are_applied_on_top_of_banned_tokens():
    logits = torch.tensor([5.0, 1.0, -1.0])
    params = dataclasses.replace(GREEDY, repetition_penalty=0.1, frequency_penalty=-2.0)
    assert sample_token(logits, params, 0, [0], [0], [0, 0]) == 1  # a banned token stays banned


def test_seeded_sampling_with_penalties_is_reproducible():
    logits = torch.randn(300, generator=torch.Generator().manual_seed(15))
    params = SamplingParams(seed=99, repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2,
                            min_p=0.01, top_k=50)
    prompt, output = list(range(0, 60, 3)), [7, 7, 9]
    first = [sample_token(logits, params, i, [], prompt, output) for i in range(20)]
    assert [sample_token(logits.clone(), params, i, [], list(prompt), tuple(output)) for i in range(20)] == first
    assert sample_token(logits, params, 11, [], prompt, output) == first[11]


# --- logit_bias ----------------------------------------------------------------


def test_a_plus_100_bias_forces_its_token_greedy_and_sampled():
    logits = torch.randn(300, generator=torch.Generator().manual_seed(40)) * 3
    target = int(logits.argmin())
    biased = dataclasses.replace(GREEDY, logit_bias=((target, 100.0),))
    assert sample_token(logits, biased, 0, []) == target
    assert draws(logits, SamplingParams(seed=41, logit_bias=((target, 100.0),)), n=100) == {target}


def test_a_minus_100_bias_bans_the_argmax():
    logits = torch.tensor([0.0, 5.0, 3.0, 4.0])
    before = logits.clone()
    assert sample_token(logits, dataclasses.replace(GREEDY, logit_bias=((1, -100.0),)), 0, []) == 3
    assert 1 not in draws(logits, SamplingParams(seed=42, logit_bias=((1, -100.0),)))
    assert torch.equal(logits, before)  # the bias went into a copy


def test_a_bias_is_added_to_the_raw_logits_before_the_penalties():
    # Repetition divides positive logits and multiplies negative ones, so the order shows: biased first,
    # token 0 is -1 + 1.5 = 0.5, then / 3 = 0.17 > 0 and wins; penalised first it would be -3 + 1.5 = -1.5.
    logits = torch.tensor([-1.0, 0.0])
    params = dataclasses.replace(GREEDY, repetition_penalty=3.0, logit_bias=((0, 1.5),))
    assert sample_token(logits, params, 1, [], [], [0]) == 0


def test_a_banned_token_stays_banned_whatever_its_bias():
    logits = torch.tensor([0.0, 1.0, 2.0])
    params = dataclasses.replace(GREEDY, min_tokens=1, logit_bias=((EOS[0], 100.0),))
    assert sample_token(logits, params, 0, banned_token_ids(params, EOS, 0)) == 2


def test_a_bias_alone_is_not_a_penalty_but_takes_the_adjusted_path():
    params = SamplingParams(logit_bias=((3, 1.0),))
    assert params.has_logit_bias and not params.has_penalties
    assert not SamplingParams().has_logit_bias
    assert sampling._adjusts_logits(SampleRow(params, 0))
    assert not sampling._adjusts_logits(SampleRow(SamplingParams(), 0))


def test_biased_rows_in_a_batch_draw_what_they_draw_alone():
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(43))
    before = logits.clone()
    rows = [
        SampleRow(GREEDY, 0),
        SampleRow(dataclasses.replace(GREEDY, logit_bias=((7, 100.0),)), 0),
        SampleRow(SamplingParams(seed=44, logit_bias=((9, 100.0), (int(logits[2].argmax()), -100.0))), 1),
        SampleRow(SamplingParams(seed=45), 2),
        SampleRow(SamplingParams(temperature=0.8, top_k=10, seed=46,
                                 logit_bias=((int(logits[4].argmax()), -100.0),)), 3),
    ]
    batch = sampling.sample_tokens(logits, rows)
    assert batch == [sample_token(logits[b], *row) for b, row in enumerate(rows)]
    assert torch.equal(logits, before)
    assert batch[0] == int(logits[0].argmax()) and batch[1] == 7 and batch[2] == 9
    assert batch[4] != int(logits[4].argmax())


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


# --- batched draws ---------------------------------------------------------------


def test_a_batch_draws_what_each_row_draws_alone():
    logits = torch.randn(7, 300, generator=torch.Generator().manual_seed(11))
    before = logits.clone()
    rows = [
        SampleRow(GREEDY, 0),
        SampleRow(SamplingParams(seed=1), 3),
        SampleRow(SamplingParams(temperature=0.7, top_k=20, seed=2), 5, banned=[int(logits[2].argmax())]),
        SampleRow(GREEDY, 1, banned=[int(logits[3].argmax())]),
        SampleRow(SamplingParams(temperature=1.3, top_p=0.8, min_p=0.01, seed=3), 0),
        SampleRow(SamplingParams(repetition_penalty=1.5, frequency_penalty=0.3, seed=4), 2, (), [1, 2], [3, 3]),
        SampleRow(SamplingParams(temperature=0.0, presence_penalty=1.0), 2, (), [], [int(logits[6].argmax())]),
    ]
    batch = sampling.sample_tokens(logits, rows)
    alone = [sample_token(logits[b], *row) for b, row in enumerate(rows)]
    assert batch == alone
    assert torch.equal(logits, before)
    assert batch[3] != int(logits[3].argmax()) and batch[6] != int(logits[6].argmax())


def test_draws_follow_the_probabilities():
    probs = torch.tensor([0.5, 0.0, 0.3, 0.15, 0.05, 0.0])
    logits = probs.clamp_min(1e-45).log().masked_fill(probs == 0, float("-inf"))
    counts = collections.Counter(sample_token(logits, SamplingParams(seed=9), i, []) for i in range(4000))
    assert counts[1] == counts[5] == 0  # probability 0 is never drawn
    for token, p in enumerate(probs.tolist()):
        if p > 0:  # within 4 standard deviations of the expected count
            assert abs(counts[token] - 4000 * p) < 4 * math.sqrt(4000 * p * (1 - p)), (token, counts)


def test_a_row_with_non_finite_probabilities_fails_alone():
    logits = torch.zeros(3, 10)
    logits[1] = float("nan")
    tokens = sampling.sample_tokens(logits, [SampleRow(SamplingParams(seed=1), 0)] * 3)
    assert isinstance(tokens[1], ValueError) and "not finite" in str(tokens[1])
    assert all(isinstance(t, int) for t in (tokens[0], tokens[2]))
    with pytest.raises(ValueError, match="not finite"):
        sample_token(logits[1], SamplingParams(seed=1), 0, [])


# --- the draw: two-level inverse CDF over unnormalised weights ----------------------


def reference_draw(weights: torch.Tensor, uniforms: list[float]) -> list[int]:
    """The straightforward draw: a full float64 running sum per row, the first entry above u * total."""
    cdf = weights.double().cumsum(-1)  # [S, V]
    targets = torch.tensor(uniforms, dtype=torch.float64)[:, None] * cdf[:, -1:]
    return torch.searchsorted(cdf, targets, right=True)[:, 0].tolist()


def draw(weights: torch.Tensor, uniforms: list[float]) -> list[int | Exception]:
    """sampling's two-level draw over weights [S, V]."""
    return sampling._draw(weights, sampling._block_sums(weights), uniforms)


def random_weights(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Weights [rows, vocab] as sample_tokens makes them: exp(logits / t - max), with a mix of row shapes:
    broad, peaked (many weights underflow to 0), a share of tokens at -inf, and a one-hot row."""
    gen = torch.Generator().manual_seed(seed)
    scale = torch.tensor([1.0, 3.0, 30.0, 3.0])[torch.arange(rows) % 4][:, None]
    logits = torch.randn(rows, vocab, generator=gen) * scale
    masked = torch.rand(rows, vocab, generator=gen) < 0.3
    masked[:, 0] = False  # every row keeps a finite token
    logits = torch.where(masked & (torch.arange(rows)[:, None] % 4 == 3), float("-inf"), logits)
    logits[-1] = float("-inf")
    logits[-1, (vocab * 2) // 3] = 0.5  # a one-hot row
    temperatures = torch.rand(rows, 1, generator=gen) + 0.3
    weights, block_sums = sampling._weights(logits / temperatures)
    assert torch.equal(block_sums, sampling._block_sums(weights))  # a few rows at a time or all: the same
    return weights


@pytest.mark.parametrize("vocab", [1, 2, 3, 255, 256, 257, 700, 1000, 32000])
def test_the_draw_matches_a_full_float64_cumsum(vocab):
    rows = 8 if vocab == 32000 else 24
    weights = random_weights(rows, vocab, seed=vocab)
    for seed in range(40 if vocab < 32000 else 10):
        uniforms = [sampling._uniform(seed, index) for index in range(rows)]
        uniforms[0], uniforms[1] = 0.0, 1.0 - 2.0**-53  # both ends of the range
        drawn = draw(weights, uniforms)
        assert drawn == reference_draw(weights, uniforms), (vocab, seed)
        assert all(weights[s, token] > 0 for s, token in enumerate(drawn))


def test_targets_on_running_sum_boundaries_skip_zero_weight_tokens():
    # integer weights: every running sum is exact, so targets land exactly on block and token boundaries
    tokens = torch.arange(600)
    weights = ((tokens % 7 != 0) & (tokens < 590) & ((tokens < 250) | (tokens >= 256))).float()[None]  # [1, 600]
    total = int(weights.sum())
    for j in range(total):
        uniform = j / total
        (token,) = draw(weights, [uniform])
        assert weights[0, token] > 0, (j, token)
        assert token == reference_draw(weights, [uniform])[0]
    assert draw(weights, [1.0 - 2.0**-53]) == [589]  # the last token of weight > 0


def test_a_block_sum_rounding_above_the_blocks_own_running_sum_draws_inside_the_block():
    # In float64, 1 + 2**-54 rounds back to 1, so the second block's running sum stays at 1.0, while its
    # block sum, adding the small weights together first, comes out above 1 (whether torch's sum does
    # depends on its summation order, so the block sums are given here as a pairwise sum makes them): a
    # target near the top lands past the block's last rise and must still take a token of positive weight.
    weights = torch.zeros(1, 512)
    weights[0, 256] = 1.0
    weights[0, 257:457] = 2.0**-54
    block_sums = torch.tensor([[0.0, 1.0 + 200 * 2.0**-54]], dtype=torch.float64)
    assert block_sums[0, 1] > weights[0, 256:].double().cumsum(-1)[-1]  # the case this test is about
    assert sampling._draw(weights, block_sums, [1.0 - 2.0**-53]) == [256]


def test_a_one_hot_row_always_draws_its_token():
    for vocab in (1, 3, 300, 32000):
        logits = torch.full((vocab,), float("-inf"))
        logits[vocab - 1] = 7.0
        assert draws(logits, SamplingParams(temperature=0.9, seed=21), n=50) == {vocab - 1}


def test_a_row_of_only_minus_inf_fails_alone():
    logits = torch.zeros(2, 300)
    logits[0] = float("-inf")
    tokens = sampling.sample_tokens(logits, [SampleRow(SamplingParams(seed=1), 0)] * 2)
    assert isinstance(tokens[0], ValueError) and isinstance(tokens[1], int)


@pytest.mark.parametrize("vocab", [1003, 32000])
def test_a_row_draws_the_same_token_alone_and_anywhere_in_a_batch(vocab):
    gen = torch.Generator().manual_seed(vocab)
    others = torch.randn(5, vocab, generator=gen) * 4
    other_rows = [SampleRow(SamplingParams(temperature=t, seed=s), s) for t, s in
                  ((0.5, 1), (1.0, 2), (0.0, 3), (1.7, 4), (0.9, 5))]
    for seed in range(3):
        row = torch.randn(vocab, generator=gen) * 3
        params = SamplingParams(temperature=0.8, seed=seed)
        alone = [sample_token(row, params, index, []) for index in range(6)]
        for position in (0, 2, 5):
            logits = torch.cat([others[:position], row[None], others[position:]])
            in_batch = [sampling.sample_tokens(logits, other_rows[:position] + [SampleRow(params, index)]
                                               + other_rows[position:])[position] for index in range(6)]
            assert in_batch == alone, (seed, position)


def chi_square(counts: collections.Counter, probs: list[float], num_draws: int) -> float:
    return sum((counts[k] - num_draws * p) ** 2 / (num_draws * p) for k, p in enumerate(probs) if p > 0)


def draw_many(logits: torch.Tensor, params: SamplingParams, num_draws: int, chunk: int = 2000) -> collections.Counter:
    """num_draws tokens of one row (indices 0..num_draws-1), drawn in batches of identical rows."""
    counts: collections.Counter = collections.Counter()
    for start in range(0, num_draws, chunk):
        size = min(chunk, num_draws - start)
        rows = [SampleRow(params, index) for index in range(start, start + size)]
        counts.update(sampling.sample_tokens(logits.expand(size, -1), rows))
    return counts


def test_draws_pass_a_chi_square_test_on_a_small_vocabulary():
    probs = [0.3, 0.0, 0.2, 0.15, 0.1, 0.1, 0.05, 0.0, 0.06, 0.04]
    logits = torch.tensor(probs).log()  # log 0 = -inf
    counts = draw_many(logits, SamplingParams(seed=31), 20000)
    assert counts[1] == counts[7] == 0
    dof = sum(p > 0 for p in probs) - 1
    assert chi_square(counts, probs, 20000) < dof + 10 * math.sqrt(2 * dof)  # a fair draw: p < 1e-6


def test_draws_pass_a_chi_square_test_across_blocks():
    # 700 tokens: blocks of 256, 256 and 188; the mass is tested per 50-token group, so the block edges count
    gen = torch.Generator().manual_seed(32)
    logits = torch.randn(700, generator=gen)
    token_probs = torch.softmax(logits.double() / 0.7, -1)
    group_probs = token_probs.view(14, 50).sum(-1).tolist()
    tokens = draw_many(logits, SamplingParams(temperature=0.7, seed=33), 20000)
    counts = collections.Counter({group: 0 for group in range(14)})
    for token, count in tokens.items():
        counts[token // 50] += count
    dof = 13
    assert chi_square(counts, group_probs, 20000) < dof + 10 * math.sqrt(2 * dof)  # a fair draw: p < 1e-6


def test_uniforms_are_pure_53_bit_fractions_below_one():
    values = [sampling._uniform(seed, index) for seed in (0, 1, 2**63, 2**64 - 1, -5) for index in range(200)]
    assert values == [sampling._uniform(seed, index) for seed in (0, 1, 2**63, 2**64 - 1, -5) for index in range(200)]
    assert all(0.0 <= u < 1.0 and (u * 2**53).is_integer() for u in values)
    assert len(set(values)) == len(values)
    assert abs(statistics.fmean(values) - 0.5) < 0.05


def test_the_largest_uniform_times_a_total_stays_below_the_total():
    largest = 1.0 - 2.0**-53
    gen = torch.Generator().manual_seed(34)
    totals = (1 + torch.rand(20000, generator=gen, dtype=torch.float64) * 32000).tolist()
    totals += [2.0**e for e in range(16)] + [math.nextafter(2.0**e, 0) for e in range(1, 16)]
    totals += [math.nextafter(2.0**e, math.inf) for e in range(16)]
    assert all(largest * total < total for total in totals)
