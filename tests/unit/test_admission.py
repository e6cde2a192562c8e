"""Admission bounds: the prefill queue's token cap and deadline, the decode block-wait bound, and the
router's picker turning excess load away from workers that publish they are full."""

from __future__ import annotations

import asyncio
import time

import pytest

from distserve.engine.decode_engine import NoCapacity
from distserve.engine.prefill_batcher import PrefillBatcher, QueueFull, QueueTimeout
from distserve.registry import WorkerRecord
from tests.builders import engine_with_blocks
from tests.unit.test_picker import decode, picker_with
from tests.unit.test_prefill_batcher import EOS, GREEDY, FakeRunner, cancel_all, prompt


def bounded_batcher(max_queued_tokens: int = 0, queue_timeout_s: float = 0.0) -> PrefillBatcher:
    return PrefillBatcher(FakeRunner(), eos_ids=(EOS,), max_context=100, max_batch_tokens=16,
                          max_queued_tokens=max_queued_tokens, queue_timeout_s=queue_timeout_s)


async def test_a_full_prefill_queue_refuses_at_once_and_takes_prompts_again_when_drained():
    batcher = bounded_batcher(max_queued_tokens=20)
    queued = [asyncio.create_task(batcher.submit(prompt(10, 12), GREEDY))]
    await asyncio.sleep(0)
    started = time.monotonic()
    with pytest.raises(QueueFull, match="12 prompt tokens outstanding, cap 20"):
        await batcher.submit(prompt(11, 9), GREEDY)
    assert time.monotonic() - started < 0.1
    queued.append(asyncio.create_task(batcher.submit(prompt(12, 8), GREEDY)))  # 12 + 8 fits the cap
    await asyncio.sleep(0)
    assert batcher.outstanding_tokens == 20
    await cancel_all(queued)
    batcher.take_batch(16)  # drops the cancelled prompts
    assert batcher.outstanding_tokens == 0


async def test_an_empty_prefill_queue_takes_a_prompt_longer_than_the_cap():
    batcher = bounded_batcher(max_queued_tokens=8)
    task = asyncio.create_task(batcher.submit(prompt(10, 30), GREEDY))
    await asyncio.sleep(0)
    assert batcher.num_waiting == 1
    await cancel_all([task])


async def test_a_prompt_waiting_past_the_queue_deadline_fails_and_a_started_one_does_not():
    batcher = bounded_batcher(queue_timeout_s=0.05)
    started = asyncio.create_task(batcher.submit(prompt(10, 20), GREEDY))  # chunked: 16 now, 4 later
    await asyncio.sleep(0)
    first = batcher.take_batch(16)
    first[0].pending.num_computed += first[0].num_tokens
    waiting = asyncio.create_task(batcher.submit(prompt(11, 4), GREEDY))
    await asyncio.sleep(0.1)
    batcher.take_batch(0)  # no budget: only expires
    with pytest.raises(QueueTimeout, match="prefill queue"):
        await waiting
    assert not started.done()
    await cancel_all([started])


async def test_block_waits_beyond_the_bound_are_refused_at_once():
    engine = engine_with_blocks(4)
    held = engine.scheduler.allocator.allocate(4)
    waiter = asyncio.ensure_future(engine.reserve_for(4, 4, timeout_s=5, max_waiting=1))
    await asyncio.sleep(0.01)
    assert engine.num_reserving == 1
    started = time.monotonic()
    with pytest.raises(NoCapacity, match="1 requests already wait"):
        await engine.reserve_for(4, 4, timeout_s=5, max_waiting=1)
    assert time.monotonic() - started < 0.1
    engine.scheduler.allocator.free(held)
    assert len(await asyncio.wait_for(waiter, 1)) == 2
    assert engine.num_reserving == 0


def prefill(worker_id: str, outstanding: int, cap: int = 1000, held: int = 0, held_cap: int = 100) -> WorkerRecord:
    load = {"outstanding_tokens": outstanding, "max_queued_tokens": cap, "held_bytes": held,
            "max_held_bytes": held_cap}
    return WorkerRecord(worker_id, "prefill", f"{worker_id}:1", load=load)


def test_picker_skips_prefill_workers_at_their_queue_or_held_kv_cap():
    queue_full, held_full, roomy = prefill("q", 998), prefill("h", 0, held=100), prefill("r", 990)
    picker = picker_with([queue_full, held_full, roomy], [])
    assert picker.pick_prefill(num_tokens=5) is roomy
    assert picker.pick_prefill(num_tokens=100) is None  # every worker's queue or held KV is full
    idle = prefill("idle", 0)
    assert picker_with([idle], []).pick_prefill(num_tokens=5000) is idle  # an idle queue takes any prompt


def test_picker_skips_decode_workers_without_free_blocks_where_as_many_wait_as_allowed():
    full = decode("full", free=0)
    full.load.update(num_reserving=4, max_reserving=4)
    waitable = decode("waitable", free=0, running=9)
    waitable.load.update(num_reserving=1, max_reserving=4)
    assert picker_with([], [full, waitable]).pick_decode(num_tokens=64) is waitable
    assert picker_with([], [full]).pick_decode(num_tokens=64) is None
