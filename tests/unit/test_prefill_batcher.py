"""PrefillBatcher: batches under the padded-token budget, in arrival order, and the run loop."""

from __future__ import annotations

import asyncio

import pytest
import torch

from distserve.engine.sampling import FinishReason, SamplingParams
from services.prefill.batcher import PrefillBatcher

EOS = 1
VOCAB = 64
BUDGET = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


class FakeRunner:
    """prefill() predicts token prompt[0] + 1 for each prompt; KV is [1, 2, 1, T, 1]."""

    def __init__(self, fail_first: bool = False):
        self.batches: list[list[list[int]]] = []
        self._fail_next = fail_first

    def prefill(self, prompts):
        self.batches.append(prompts)
        if self._fail_next:
            self._fail_next = False
            raise RuntimeError("forward failed")
        logits = torch.zeros(len(prompts), VOCAB)
        for b, prompt in enumerate(prompts):
            logits[b, prompt[0] + 1] = 10.0
        kvs = [torch.full((1, 2, 1, len(p), 1), float(p[0])) for p in prompts]
        return logits, kvs


def make_batcher(runner=None, budget: int = BUDGET) -> PrefillBatcher:
    return PrefillBatcher(runner or FakeRunner(), eos_ids=(EOS,), max_context=100, max_batch_tokens=budget)


def prompt(tag: int, length: int) -> list[int]:
    return [tag] * length


async def enqueue(batcher: PrefillBatcher, lengths: list[int], params=GREEDY) -> list[asyncio.Task]:
    """Submits prompts tagged 10, 11, ... in order and lets them reach the queue."""
    tasks = [asyncio.create_task(batcher.submit(prompt(10 + i, n), params)) for i, n in enumerate(lengths)]
    await asyncio.sleep(0)
    return tasks


async def cancel_all(tasks) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def tags(batch) -> list[int]:
    return [p.prompt[0] for p in batch]


@pytest.mark.parametrize("lengths, expected_batches", [
    ([4, 4, 4, 4, 4], [[10, 11, 12, 13], [14]]),  # 4 x 4 = 16 fits, a fifth does not
    ([2, 8, 2], [[10, 11], [12]]),  # longest 8 x 3 = 24 > 16
    ([20, 2], [[10], [11]]),  # over budget: runs alone
    ([2, 20, 2], [[10], [11], [12]]),  # the later short prompt does not jump the long one
    ([1] * 20, [[10 + i for i in range(16)], [26, 27, 28, 29]]),
])
async def test_take_batch_respects_the_padded_token_budget_in_arrival_order(lengths, expected_batches):
    batcher = make_batcher()
    tasks = await enqueue(batcher, lengths)
    try:
        assert batcher.num_waiting == len(lengths) and batcher.outstanding_tokens == sum(lengths)
        assert [tags(batcher._take_batch()) for _ in expected_batches] == expected_batches
        assert batcher._take_batch() == [] and batcher.num_waiting == 0
    finally:
        await cancel_all(tasks)


async def test_cancelled_submissions_are_skipped():
    batcher = make_batcher()
    tasks = await enqueue(batcher, [4, 4, 4, 8])
    tasks[1].cancel()
    await asyncio.sleep(0)
    try:
        assert tags(batcher._take_batch()) == [10, 12]  # 8 x 3 would not fit
        assert tags(batcher._take_batch()) == [13]
    finally:
        await cancel_all(tasks)


async def run_batcher(batcher: PrefillBatcher, submissions: list[tuple[list[int], SamplingParams]]):
    """Queues the submissions, then runs the loop until they are all answered."""
    tasks = [asyncio.create_task(batcher.submit(p, params)) for p, params in submissions]
    await asyncio.sleep(0)
    loop_task = asyncio.create_task(batcher.run())
    try:
        return await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout=10)
    finally:
        await cancel_all([loop_task, *tasks])


async def test_run_answers_every_submission_and_counts_batches():
    runner = FakeRunner()
    batcher = make_batcher(runner)
    results = await run_batcher(batcher, [(prompt(10 + i, 4), GREEDY) for i in range(5)])

    assert [r.first_token for r in results] == [11, 12, 13, 14, 15]
    assert [r.kv.shape for r in results] == [(1, 2, 1, 4, 1)] * 5
    assert all(r.kv[0, 0, 0, 0, 0] == 10 + i for i, r in enumerate(results))
    assert all(r.finish_reason is None and r.queue_s >= 0 and r.prefill_s >= 0 for r in results)
    assert [len(b) for b in runner.batches] == [4, 1]
    assert (batcher.num_batches, batcher.max_batch_size, batcher.num_running_tokens) == (2, 4, 0)
    assert batcher.num_waiting == 0


async def test_run_sets_the_first_tokens_finish_reason():
    batcher = make_batcher()
    results = await run_batcher(batcher, [
        (prompt(EOS - 1, 3), GREEDY),  # predicts EOS
        (prompt(EOS - 1, 3), SamplingParams(temperature=0.0, min_tokens=1)),  # EOS banned: next best
        (prompt(20, 3), SamplingParams(temperature=0.0, max_tokens=1)),
    ])
    assert results[0].finish_reason is FinishReason.STOP and results[0].first_token == EOS
    assert results[1].finish_reason is None and results[1].first_token != EOS
    assert results[2].finish_reason is FinishReason.LENGTH and results[2].first_token == 21


async def test_a_failed_forward_fails_its_batch_and_the_loop_goes_on():
    runner = FakeRunner(fail_first=True)
    batcher = make_batcher(runner, budget=4)
    results = await run_batcher(batcher, [(prompt(10, 4), GREEDY), (prompt(11, 4), GREEDY)])
    assert isinstance(results[0], RuntimeError)
    assert results[1].first_token == 12
    assert batcher.num_batches == 2
