"""The prefix-cache event feed: engines record stores and evictions, workers publish them to a real
Redis stream, routers fold them into their index under the same keys the workers compute."""

from __future__ import annotations

import asyncio

import torch

from distserve.engine.kv_cache import BlockAllocator
from distserve.engine.prefix_cache import PrefixCache
from distserve.engine.shared_blocks import SharedBlocks
from distserve.prefix_events import (EVICTED, MAX_KEYS_PER_ENTRY, PAGED_CACHE, PREFILL_CACHE, RESET, STORED,
                                     STREAM_KEY, PrefixEvent, PrefixEventLog, attach_prefix_events,
                                     follow_prefix_events, parse_entry, publish_prefix_events)
from distserve.prefix_hash import PrefixNamespace
from distserve.prefix_index import PromptBlocks
from distserve.registry import WorkerRecord
from services.router.picker import WorkerPicker

BLOCK = 4
KEY = bytes(range(32))


def test_the_log_splits_long_runs_and_drains_in_order():
    events = PrefixEventLog()
    keys = [bytes([i % 256]) * 32 for i in range(MAX_KEYS_PER_ENTRY + 3)]
    events.stored(PREFILL_CACHE, keys)
    events.evicted(PAGED_CACHE, keys[:1])
    events.stored(PREFILL_CACHE, [])  # nothing to say
    drained = events.drain()
    assert [(cache, op, len(run)) for cache, op, run in drained] == [
        (PREFILL_CACHE, STORED, MAX_KEYS_PER_ENTRY), (PREFILL_CACHE, STORED, 3), (PAGED_CACHE, EVICTED, 1)]
    assert drained[0][2] + drained[1][2] == tuple(keys)
    assert events.drain() == []


def test_while_redis_is_away_the_oldest_events_are_dropped():
    events = PrefixEventLog(max_pending=2)
    for i in range(5):
        events.stored(PREFILL_CACHE, [bytes([i]) * 32])
    assert [run[0][0] for _, _, run in events.drain()] == [3, 4] and events.num_dropped == 3


def test_malformed_entries_are_refused():
    good = {b"w": b"p0", b"c": b"prefill", b"op": b"+", b"k": KEY * 2}
    assert parse_entry(good) == PrefixEvent("p0", PREFILL_CACHE, STORED, (KEY, KEY))
    for broken in ({**good, b"k": KEY + b"x"}, {**good, b"op": b"?"}, {**good, b"c": b"other"},
                   {k: v for k, v in good.items() if k != b"w"}, {**good, b"w": b"\xff"}):
        assert parse_entry(broken) is None


def test_the_prefix_cache_tells_what_it_stores_and_evicts():
    cache = PrefixCache(PrefixNamespace("m", "float32", BLOCK), num_blocks=2, num_layers=1, num_kv_heads=1,
                        head_dim=2, dtype=torch.float32)
    cache.events = PrefixEventLog()
    kv = torch.zeros(1, 2, 3 * BLOCK, 1, 2)
    first, second = cache.keys(list(range(2 * BLOCK))), cache.keys(list(range(100, 100 + BLOCK)))
    cache.store(first, kv)
    cache.store(first, kv)  # cached already: no event
    cache.store(second, kv)  # evicts the least recently used block: the first chain's tail
    assert cache.events.drain() == [(PREFILL_CACHE, STORED, tuple(first)), (PREFILL_CACHE, EVICTED, (first[1],)),
                                    (PREFILL_CACHE, STORED, tuple(second))]


def test_the_paged_cache_tells_what_it_lists_and_forgets():
    allocator = BlockAllocator(2)
    shared = SharedBlocks(allocator)
    shared.events = PrefixEventLog()
    blocks = allocator.allocate(2)
    shared.add([KEY, b"k" * 32], blocks)
    shared.add([KEY], blocks[:1])  # listed already
    allocator.free(blocks)  # kept cached while listed
    allocator.allocate(1)  # evicts one: a sequence's tail block goes first
    assert shared.events.drain() == [(PAGED_CACHE, STORED, (KEY, b"k" * 32)), (PAGED_CACHE, EVICTED, (b"k" * 32,))]


async def test_a_router_follows_what_a_worker_publishes_through_redis(redis_client):
    await redis_client.delete(STREAM_KEY)
    prefill_cache = PrefixCache(PrefixNamespace("m", "float32", BLOCK), 8, 1, 1, 2, torch.float32)
    (publish,) = attach_prefix_events(redis_client, "p0", prefill_cache=prefill_cache)
    prefill_cache.store([KEY], torch.zeros(1, 2, BLOCK, 1, 2))
    seen: list[PrefixEvent] = []
    tasks = [asyncio.create_task(publish()), asyncio.create_task(follow_prefix_events(redis_client, seen.append,
                                                                                      block_ms=50))]
    try:
        for _ in range(200):
            if len(seen) >= 2:
                break
            await asyncio.sleep(0.01)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    assert seen == [PrefixEvent("p0", PREFILL_CACHE, RESET), PrefixEvent("p0", PREFILL_CACHE, STORED, (KEY,))]
    assert attach_prefix_events(redis_client, "p1") == []  # nothing cached: nothing to publish


async def test_after_a_failed_publish_the_next_round_starts_with_a_reset(redis_client, caplog):
    """The events of a failed round are lost (evictions among them), so routers are told to forget."""
    await redis_client.delete(STREAM_KEY)
    failures = [1]

    class FlakyRedis:
        def pipeline(self, transaction):
            if failures:
                failures.pop()
                raise ConnectionError("redis is away")
            return redis_client.pipeline(transaction=transaction)

    events = PrefixEventLog()
    events.evicted(PREFILL_CACHE, [KEY])  # lost with the failed round
    task = asyncio.create_task(publish_prefix_events(FlakyRedis(), "p0", events, (PREFILL_CACHE,), interval_s=0.01))
    try:
        for _ in range(200):
            if await redis_client.xlen(STREAM_KEY):
                break
            await asyncio.sleep(0.01)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert "publishing 2 prefix events failed" in caplog.text
    published = [parse_entry(fields) for _, fields in await redis_client.xrange(STREAM_KEY)]
    assert published == [PrefixEvent("p0", PREFILL_CACHE, RESET)]


async def test_an_event_the_router_cannot_apply_is_logged_and_the_rest_still_apply(redis_client, caplog):
    await redis_client.delete(STREAM_KEY)
    for worker in ("bad", "good"):
        await redis_client.xadd(STREAM_KEY, {"w": worker, "c": PREFILL_CACHE, "op": RESET, "k": b""})
    seen = []

    def apply(event):
        if event.worker_id == "bad":
            raise KeyError("no such worker")
        seen.append(event.worker_id)

    task = asyncio.create_task(follow_prefix_events(redis_client, apply, block_ms=50))
    try:
        for _ in range(200):
            if seen:
                break
            await asyncio.sleep(0.01)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert seen == ["good"] and "applying prefix event" in caplog.text


def test_router_keys_are_the_workers_keys():
    tokens = list(range(3 * BLOCK + 1))
    for salt in ("", "tenant"):
        worker = PrefixCache(PrefixNamespace("default:small", "bfloat16", BLOCK, "seed-1"), 1, 1, 1, 2, torch.float32)
        router = PromptBlocks("default:small", tokens, salt, deployment_seed="seed-1")
        assert router.keys(BLOCK, "bfloat16") == worker.keys(tokens, salt)
        assert PromptBlocks("default:small", tokens, salt).keys(BLOCK, "bfloat16") != worker.keys(tokens, salt)


def test_the_picker_folds_stores_evictions_and_resets_per_cache():
    picker = WorkerPicker(registry=None, suspect_s=5.0)
    worker = WorkerRecord("p0", "prefill", "h:1", load={"prefix_block_size": BLOCK, "prefix_cache_blocks": 2},
                          kv_format="1x1x2:float32")
    picker._workers["prefill"] = [worker]
    prompt = PromptBlocks("m", list(range(3 * BLOCK + 1)))
    keys = prompt.keys(BLOCK, "float32")
    picker.apply_prefix_event(PrefixEvent("p0", PREFILL_CACHE, STORED, tuple(keys)))
    # the worker's published capacity bounds the estimate: the chain's head survives, as in its pool
    assert picker.cached_tokens(worker, prompt) == 2 * BLOCK
    assert picker.decode_blocks.num_blocks("p0") == 0  # its paged cache is another index
    picker.apply_prefix_event(PrefixEvent("p0", PREFILL_CACHE, EVICTED, (keys[1],)))
    assert picker.cached_tokens(worker, prompt) == BLOCK
    picker.apply_prefix_event(PrefixEvent("p0", PAGED_CACHE, STORED, tuple(keys)))
    picker.apply_prefix_event(PrefixEvent("p0", PREFILL_CACHE, RESET))
    assert picker.cached_tokens(worker, prompt) == 0 and picker.decode_blocks.num_blocks("p0") == 3


def test_a_colocated_workers_paged_cache_counts_for_its_prompts():
    """Its prefill reads its paged cache too (earlier answers), so what that cache lists counts; a
    spill-only half's does not (the router reaches those through pick_prefix_spill)."""
    picker = WorkerPicker(registry=None, suspect_s=5.0)
    load = {"prefix_block_size": BLOCK, "prefix_cache_blocks": 64, "block_size": BLOCK, "total_blocks": 64,
            "prefix_caching": 1}
    dedicated = WorkerRecord("c0", "colocated", "h:1", load=load, kv_format="1x1x2:float32")
    spill_half = WorkerRecord("d0", "colocated", "h:2", load={**load, "spill_only": 1}, kv_format="1x1x2:float32")
    picker._workers["colocated"] = [dedicated, spill_half]
    chat = PromptBlocks("m", list(range(3 * BLOCK + 1)))
    for worker in ("c0", "d0"):
        picker.apply_prefix_event(PrefixEvent(worker, PAGED_CACHE, STORED, tuple(chat.keys(BLOCK, "float32"))))
    assert picker.cached_tokens(dedicated, chat) == 3 * BLOCK
    assert picker.cached_tokens(spill_half, chat) == 0
