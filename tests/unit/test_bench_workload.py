"""The bench's workloads: deterministic, in range, shaped as documented, clipped to the context."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest

from distserve.bench import workload
from distserve.bench.workload import (
    MIN_LEN,
    MIXES,
    parse_length,
    poisson_arrivals,
    sample_lengths,
    synthetic_prompt,
    synthetic_prompts,
)


@pytest.mark.parametrize("workload", ["fixed", "chat", "code", "summarize"])
def test_same_seed_same_lengths_other_seed_other_lengths(workload):
    kwargs = {"input_len": "10-500", "output_len": "5-50"} if workload == "fixed" else {}
    first = sample_lengths(workload, 200, seed=7, **kwargs)
    assert first == sample_lengths(workload, 200, seed=7, **kwargs)
    assert first != sample_lengths(workload, 200, seed=8, **kwargs)
    assert len(first) == 200 and all(isinstance(n, int) for pair in first for n in pair)


def test_fixed_lengths_and_ranges():
    assert sample_lengths("fixed", 5, 0, input_len="16", output_len="8") == [(16, 8)] * 5
    pairs = sample_lengths("fixed", 2000, 0, input_len="10-20", output_len="3-4")
    assert {i for i, _ in pairs} == set(range(10, 21))
    assert {o for _, o in pairs} == {3, 4}


@pytest.mark.parametrize("spec", ["0", "5-4", "a", "1-2-3", "-3", ""])
def test_bad_length_names_the_field(spec):
    with pytest.raises(ValueError, match="input_len"):
        parse_length("input_len", spec)


def test_unknown_workload_lists_the_choices():
    with pytest.raises(ValueError, match="fixed, chat, code, summarize"):
        sample_lengths("poetry", 1, 0)


@pytest.mark.parametrize("name", sorted(MIXES))
def test_mix_medians_near_documented_values(name):
    pairs = sample_lengths(name, 20000, seed=1)
    mix = MIXES[name]
    assert statistics.median(i for i, _ in pairs) == pytest.approx(mix.input.median, rel=0.05)
    assert statistics.median(o for _, o in pairs) == pytest.approx(mix.output.median, rel=0.05)
    assert min(min(pair) for pair in pairs) >= MIN_LEN


def test_mixes_differ_in_shape_as_documented():
    chat, code, summ = (sample_lengths(n, 5000, seed=2) for n in ("chat", "code", "summarize"))
    mean_in = {k: statistics.mean(i for i, _ in v) for k, v in (("chat", chat), ("code", code), ("summ", summ))}
    assert mean_in["code"] < mean_in["chat"] < mean_in["summ"]
    # summarization: long inputs, short outputs
    assert statistics.median(o for _, o in summ) * 5 < statistics.median(i for i, _ in summ)


def test_max_context_shrinks_input_first():
    pairs = sample_lengths("fixed", 3, 0, input_len="100", output_len="30", max_context=64)
    assert pairs == [(34, 30)] * 3
    # the output alone over the limit: input at its floor, output takes the rest
    assert sample_lengths("fixed", 1, 0, input_len="100", output_len="80", max_context=64) == [(MIN_LEN, 60)]
    for i, o in sample_lengths("summarize", 500, 0, max_context=1024):
        assert i + o <= 1024 and i >= MIN_LEN and o >= 1


def test_max_context_too_small_names_the_field():
    with pytest.raises(ValueError, match="max_context"):
        sample_lengths("chat", 1, 0, max_context=5)


def test_poisson_mean_gap_is_one_over_rate():
    arrivals = poisson_arrivals(4.0, 20001, seed=3)
    gaps = np.diff(arrivals)
    assert arrivals[0] == 0.0 and (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    assert gaps.std() == pytest.approx(0.25, rel=0.05)  # exponential: std == mean
    assert arrivals == poisson_arrivals(4.0, 20001, seed=3)


def test_poisson_infinite_rate_sends_at_once_and_bad_rate_raises():
    assert poisson_arrivals(math.inf, 4, seed=0) == [0.0] * 4
    with pytest.raises(ValueError, match="rate"):
        poisson_arrivals(0.0, 4, seed=0)


def test_synthetic_prompts_avoid_special_ids_and_are_deterministic():
    prompt = synthetic_prompt(5000, 10, np.random.default_rng(0))
    assert len(prompt) == 5000 and set(prompt) == set(range(3, 10))
    lengths = [(7, 1), (3, 2)]
    assert [len(p) for p in synthetic_prompts(lengths, 100, seed=1)] == [7, 3]
    assert synthetic_prompts(lengths, 100, seed=1) == synthetic_prompts(lengths, 100, seed=1)


def test_each_run_draws_new_prompts_of_the_same_lengths():
    """A prefix-caching server must not see a later rate's prompts again."""
    lengths = [(5, 1), (9, 1), (3, 1)]
    first, second = (workload.synthetic_prompts(lengths, 1000, seed=0, run=r) for r in (0, 1))
    assert [len(p) for p in first] == [len(p) for p in second] == [5, 9, 3]
    assert all(a != b for a, b in zip(first, second))
    assert workload.synthetic_prompts(lengths, 1000, seed=0, run=1) == second


def test_a_prefix_len_gives_every_prompt_the_same_head_drawn_per_run():
    lengths = [(5, 1), (7, 1)]
    first = workload.synthetic_prompts(lengths, 100, seed=0, run=0, prefix_len=4)
    assert [len(p) for p in first] == [9, 11] and first[0][:4] == first[1][:4]
    assert first[0][4:] != first[1][4:9]
    later = workload.synthetic_prompts(lengths, 100, seed=0, run=1, prefix_len=4)
    assert later[0][:4] != first[0][:4]


def test_conversations_share_one_system_prompt_per_run():
    from distserve.bench.conversations import ChatShape, sample_conversations

    shape = ChatShape(num_conversations=3, num_turns=2, system_len=6, user_len=4)
    chats = sample_conversations(shape, 100, seed=0)
    assert len(chats) == 3 and all(c.system == chats[0].system and len(c.system) == 6 for c in chats)
    assert all(len(c.user_turns) == 2 and all(len(u) == 4 for u in c.user_turns) for c in chats)
    assert chats[0].user_turns != chats[1].user_turns
    assert sample_conversations(shape, 100, seed=0, run=1)[0].system != chats[0].system
