"""PrefillBatcher: packed, chunked batches under the token budget, without starvation, and the run loop."""

from __future__ import annotations

import asyncio

import pytest
import torch

from distserve.request_types import FinishReason, SamplingParams
from distserve.engine.model_runner import PrefillWork
from distserve.engine.prefill_batcher import MAX_SKIPS, PrefillBatcher

EOS = 1
VOCAB = 64
BUDGET = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


class FakeRunner:
    """Predicts token t + 1 for a prompt of tag t; fills the KV buffer [1, 2, T, 1, 1] with the tag."""

    def __init__(self, fail_first: bool = False):
        self.batches: list[list[PrefillWork]] = []
        self._fail_next = fail_first

    def new_kv_buffer(self, num_tokens: int) -> torch.Tensor:
        return torch.full((1, 2, num_tokens, 1, 1), -1.0)

    def prefill_chunks(self, works: list[PrefillWork]) -> torch.Tensor:
        self.batches.append(works)
        if self._fail_next:
            self._fail_next = False
            raise RuntimeError("forward failed")
        for work in works:
            work.kv[:, :, work.position:work.position + len(work.token_ids)] = float(work.token_ids[0])
        last = [w for w in works if w.is_last]
        logits = torch.zeros(len(last), VOCAB)
        for row, work in enumerate(last):
            logits[row, work.token_ids[0] + 1] = 10.0
        return logits


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
    return [s.pending.prompt[0] for s in batch]


def take_and_account(batcher: PrefillBatcher) -> list[tuple[int, int]]:
    """Takes a batch and marks its tokens computed, as a forward would: [(tag, tokens)]."""
    batch = batcher.take_batch(batcher.max_batch_tokens)
    for piece in batch:
        piece.pending.num_computed += piece.num_tokens
    return [(s.pending.prompt[0], s.num_tokens) for s in batch]


@pytest.mark.parametrize("lengths, expected_batches", [
    ([4, 4, 4, 4, 4], [[(10, 4), (11, 4), (12, 4), (13, 4)], [(14, 4)]]),  # 16 packed tokens fit, not 20
    ([2, 8, 2], [[(10, 2), (11, 8), (12, 2)]]),  # packed, no padding: 12 tokens
    ([20, 2], [[(10, 14), (11, 2)], [(10, 6)]]),  # the long one is chunked; the short one is not stalled
    ([2, 20, 2], [[(10, 2), (11, 12), (12, 2)], [(11, 8)]]),
    ([1] * 20, [[(10 + i, 1) for i in range(16)], [(26, 1), (27, 1), (28, 1), (29, 1)]]),
])
async def test_take_batch_packs_and_chunks_under_the_token_budget(lengths, expected_batches):
    batcher = make_batcher()
    tasks = await enqueue(batcher, lengths)
    try:
        assert batcher.num_waiting == len(lengths) and batcher.outstanding_tokens == sum(lengths)
        assert [take_and_account(batcher) for _ in expected_batches] == expected_batches
        assert batcher.take_batch(batcher.max_batch_tokens) == [] and batcher.num_waiting == 0
    finally:
        await cancel_all(tasks)


async def test_a_long_prompt_skipped_max_skips_times_goes_first():
    batcher = make_batcher()
    tasks = await enqueue(batcher, [30] + [BUDGET] * (MAX_SKIPS + 2))
    try:
        skipped = [take_and_account(batcher) for _ in range(MAX_SKIPS)]
        assert skipped == [[(11 + i, BUDGET)] for i in range(MAX_SKIPS)]  # short prompts that fit go first
        assert take_and_account(batcher) == [(10, BUDGET)]  # then the starving one takes the budget
    finally:
        await cancel_all(tasks)


async def test_a_chunked_prompt_gets_its_whole_kv_and_one_answer():
    runner = FakeRunner()
    batcher = make_batcher(runner)
    (result,) = await run_batcher(batcher, [(prompt(7, 40), GREEDY)])
    assert result.first_token == 8 and result.num_chunks == 3
    assert [[len(w.token_ids) for w in batch] for batch in runner.batches] == [[16], [16], [8]]
    assert [w.position for batch in runner.batches for w in batch] == [0, 16, 32]
    assert result.kv.shape == (1, 2, 40, 1, 1) and bool((result.kv == 7).all())


async def test_cancelled_submissions_are_skipped():
    batcher = make_batcher()
    tasks = await enqueue(batcher, [4, 4, 4, 8])
    tasks[1].cancel()
    await asyncio.sleep(0)
    try:
        assert tags(batcher.take_batch(batcher.max_batch_tokens)) == [10, 12, 13]  # 4 + 4 + 8 = 16 packed tokens
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
    assert [r.kv.shape for r in results] == [(1, 2, 4, 1, 1)] * 5
    assert all(bool((r.kv == 10 + i).all()) for i, r in enumerate(results))
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
