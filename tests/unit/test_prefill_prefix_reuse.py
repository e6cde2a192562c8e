"""The prefill batcher with a prefix cache, over the real tiny model (fp32): the KV and first token of
a prompt whose prefix came from the cache equal those computed whole, chunked or not, and while the
cache evicts under pressure."""

from __future__ import annotations

import asyncio

import pytest
import torch

from distserve.engine.model_loader import load_engine_model
from distserve.engine.model_runner import ModelRunner
from distserve.engine.prefill_batcher import PrefillBatcher
from distserve.engine.prefix_cache import PrefixCache
from distserve.request_types import SamplingParams
from distserve.prefix_hash import PrefixNamespace

BLOCK = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=4)


@pytest.fixture(scope="module")
def runner(tiny_model_path):
    return ModelRunner(load_engine_model(tiny_model_path, "float32", "cpu"))


def make_cache(runner: ModelRunner, num_blocks: int) -> PrefixCache:
    a = runner.model.args
    return PrefixCache(PrefixNamespace("tiny", "float32", BLOCK), num_blocks, a.num_layers, a.num_kv_heads,
                       a.head_dim, torch.float32)


async def prefill_all(runner, prompts, budget, cache=None, params=GREEDY):
    batcher = PrefillBatcher(runner, eos_ids=(), max_context=512, max_batch_tokens=budget, prefix_cache=cache)
    loop = asyncio.create_task(batcher.run())
    try:
        return [await batcher.submit(p, params) for p in prompts]  # one at a time: each may hit the last
    finally:
        loop.cancel()


def prompts_sharing(prefix_len: int, num: int, seed: int = 3) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, 200, (prefix_len,), generator=generator).tolist()
    return [prefix + torch.randint(3, 200, (5 + i,), generator=generator).tolist() for i in range(num)]


@pytest.mark.parametrize("budget", [256, 12])  # whole prompts, or chunks of 12 tokens
async def test_cached_prefixes_give_the_kv_and_first_token_of_a_whole_prefill(runner, budget):
    prompts = prompts_sharing(4 * BLOCK + 3, 3)
    plain = await prefill_all(runner, prompts, budget)
    cache = make_cache(runner, 64)
    cached = await prefill_all(runner, prompts, budget, cache)
    assert [r.num_cached_tokens for r in cached] == [0, 4 * BLOCK, 4 * BLOCK]
    for a, b in zip(plain, cached):
        assert a.first_token == b.first_token
        torch.testing.assert_close(a.kv, b.kv, rtol=1e-5, atol=1e-5)
    assert cache.stats.hit_tokens == 8 * BLOCK


async def test_prompts_arriving_together_compute_their_shared_prefix_once(runner):
    """Chunked (12 tokens a forward): the first prompt's chunks are stored as they finish, and the
    others, still waiting, find them before their own first chunk."""
    prompts = prompts_sharing(4 * BLOCK + 3, 3, seed=5)
    plain = await prefill_all(runner, prompts, 12)
    cache = make_cache(runner, 64)
    batcher = PrefillBatcher(runner, eos_ids=(), max_context=512, max_batch_tokens=12, prefix_cache=cache)
    loop = asyncio.create_task(batcher.run())
    try:
        together = await asyncio.gather(*(batcher.submit(p, GREEDY) for p in prompts))
    finally:
        loop.cancel()
    assert [r.num_cached_tokens for r in together] == [0, 4 * BLOCK, 4 * BLOCK]
    assert [r.first_token for r in together] == [r.first_token for r in plain]
    assert cache.stats.queried_tokens == sum(map(len, prompts)) and cache.stats.hit_tokens == 8 * BLOCK


async def test_eviction_under_pressure_keeps_output_exact(runner):
    families = zip(prompts_sharing(3 * BLOCK, 3), prompts_sharing(2 * BLOCK + 1, 3, seed=4))
    prompts = [p for pair in families for p in pair]  # the two families alternate
    plain = await prefill_all(runner, prompts, 256)
    cache = make_cache(runner, 4)  # room for one prompt's prefix at a time
    cached = await prefill_all(runner, prompts, 256, cache)
    assert cache.stats.evicted_blocks > 0
    assert [a.first_token for a in plain] == [b.first_token for b in cached]
    for a, b in zip(plain, cached):
        torch.testing.assert_close(a.kv, b.kv, rtol=1e-5, atol=1e-5)


async def test_prompt_logprobs_skip_the_lookup_but_store(runner):
    prompts = prompts_sharing(2 * BLOCK, 2)
    cache = make_cache(runner, 16)
    results = await prefill_all(runner, prompts, 256, cache, SamplingParams(temperature=0.0, prompt_logprobs=0))
    assert [r.num_cached_tokens for r in results] == [0, 0]
    assert len(results[1].prompt_logprobs) == len(prompts[1]) - 1
    assert (await prefill_all(runner, prompts[:1], 256, cache))[0].num_cached_tokens == 2 * BLOCK


async def test_a_cancelled_prompt_unpins_its_prefix(runner):
    prompts = prompts_sharing(2 * BLOCK, 2)
    cache = make_cache(runner, 16)
    await prefill_all(runner, prompts[:1], 256, cache)
    batcher = PrefillBatcher(runner, eos_ids=(), max_context=512, max_batch_tokens=256, prefix_cache=cache)
    waiting = asyncio.create_task(batcher.submit(prompts[1], GREEDY))  # no loop runs: it stays queued
    await asyncio.sleep(0)
    assert cache._refs  # pinned while it waits
    waiting.cancel()
    await asyncio.sleep(0)
    batcher.take_batch(256)
    assert not cache._refs
