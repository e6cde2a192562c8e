"""Logprobs: the math on its own, and through the real tiny model's prefill (chunked or not) and decode
steps, against transformers' log-softmax (fp32, within 1e-4)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from distserve.engine.logprobs import rows_logprobs, token_logprobs
from distserve.engine.model_loader import load_engine_model, load_model
from distserve.engine.model_runner import ModelRunner
from distserve.engine.prefill_batcher import PrefillBatcher
from distserve.request_types import SamplingParams
from tests.builders import engine_with_runner

TOLERANCE = 1e-4


def test_rows_logprobs_are_log_softmax_with_rank_and_sorted_alternatives():
    logits = torch.tensor([[2.0, 1.0, 3.0, 0.0], [0.0, 0.0, 5.0, -1.0]])
    first, second = rows_logprobs(logits, [1, 2], num_top=2)
    expected = torch.log_softmax(logits, -1)
    assert first.logprob == pytest.approx(float(expected[0, 1]))
    assert first.rank == 3  # tokens 2 and 0 are more likely
    assert first.top_token_ids == (2, 0)
    assert first.top_logprobs == pytest.approx((float(expected[0, 2]), float(expected[0, 0])))
    assert second.rank == 1 and second.top_token_ids[0] == 2  # tokens 0 and 1 tie for second


def test_no_alternatives_when_none_are_asked_for():
    entry = token_logprobs(torch.tensor([0.5, 0.1]), 0, num_top=0)
    assert entry.top_token_ids == () and entry.top_logprobs == () and entry.rank == 1


@pytest.fixture(scope="module")
def reference(tiny_model_path):
    return load_model(tiny_model_path, "float32", "cpu")


@pytest.fixture(scope="module")
def runner(tiny_model_path):
    return ModelRunner(load_engine_model(tiny_model_path, "float32", "cpu"))


def reference_logprobs(reference, tokens: list[int]) -> torch.Tensor:
    """transformers' log-softmax at every position of `tokens`: [T, V]."""
    with torch.no_grad():
        return torch.log_softmax(reference(torch.tensor([tokens])).logits[0].float(), -1)


@pytest.mark.parametrize("budget", [64, 7])  # one forward, or chunks of 7 tokens
async def test_prompt_and_first_token_logprobs_match_transformers(runner, reference, budget):
    prompt = list(range(10, 30))
    batcher = PrefillBatcher(runner, eos_ids=(), max_context=128, max_batch_tokens=budget)
    loop = asyncio.create_task(batcher.run())
    try:
        result = await batcher.submit(prompt, SamplingParams(temperature=0.0, logprobs=3, prompt_logprobs=2))
    finally:
        loop.cancel()
    expected = reference_logprobs(reference, prompt)
    assert [e.token_id for e in result.prompt_logprobs] == prompt[1:]
    for position, entry in enumerate(result.prompt_logprobs):
        assert entry.logprob == pytest.approx(float(expected[position, prompt[position + 1]]), abs=TOLERANCE)
        assert len(entry.top_token_ids) == 2
        assert entry.top_logprobs[0] == pytest.approx(float(expected[position].max()), abs=TOLERANCE)
    first = result.first_token_logprobs
    assert first.token_id == result.first_token and first.rank == 1  # greedy
    assert first.logprob == pytest.approx(float(expected[-1].max()), abs=TOLERANCE)
    assert len(first.top_token_ids) == 3 and first.top_token_ids[0] == result.first_token


async def test_no_logprobs_unless_asked_for(runner):
    batcher = PrefillBatcher(runner, eos_ids=(), max_context=128, max_batch_tokens=64)
    loop = asyncio.create_task(batcher.run())
    try:
        result = await batcher.submit([5, 6, 7], SamplingParams(temperature=0.0))
    finally:
        loop.cancel()
    assert result.first_token_logprobs is None and result.prompt_logprobs is None


def test_decode_step_logprobs_match_transformers(runner, reference):
    """Two sequences in one step, one asking for logprobs and one not; sampled (seeded) tokens keep their
    raw-model logprob, whatever temperature did."""
    engine, seqs = engine_with_runner(runner, [[3, 4, 5, 6], [7, 8, 9]], [
        SamplingParams(temperature=0.8, seed=1, logprobs=5), SamplingParams(temperature=0.0)])
    work = engine.work(seqs)
    tokens, logprobs = engine.sample(seqs, runner.decode(work.kv_cache, work.tables, work.context_lens,
                                                         work.input_ids))
    assert logprobs[1] is None
    expected = reference_logprobs(reference, seqs[0].tokens)[-1]
    assert logprobs[0].token_id == tokens[0]
    assert logprobs[0].logprob == pytest.approx(float(expected[tokens[0]]), abs=TOLERANCE)
    assert logprobs[0].top_logprobs == pytest.approx(expected.topk(5).values.tolist(), abs=TOLERANCE)
