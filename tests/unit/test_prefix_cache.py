"""The prefix cache's block pool: lookups pin, releases unpin, stores skip what is cached, and
eviction takes unpinned blocks least recently used first, a chain's tail before its head."""

from __future__ import annotations

import torch

from distserve.engine.prefix_cache import PrefixCache, prefix_cache_blocks
from distserve.prefix_hash import PrefixNamespace

BLOCK = 4
LAYERS, HEADS, DIM = 2, 1, 3


def make_cache(num_blocks: int) -> PrefixCache:
    return PrefixCache(PrefixNamespace("m", "float32", BLOCK), num_blocks, LAYERS, HEADS, DIM, torch.float32)


def prompt_kv(tokens: list[int]) -> torch.Tensor:
    """A KV buffer [L, 2, T, H, D] whose values name their token and position, so copies can be checked."""
    kv = torch.zeros(LAYERS, 2, len(tokens), HEADS, DIM)
    for position, token in enumerate(tokens):
        kv[:, :, position] = token * 1000 + position
    return kv


def store_prompt(cache: PrefixCache, tokens: list[int]) -> list[bytes]:
    keys = cache.keys(tokens)
    cache.store(keys, prompt_kv(tokens))
    return keys


def test_a_stored_prefix_is_found_and_copied_exactly():
    cache = make_cache(8)
    first = list(range(1, 13))  # three full blocks
    store_prompt(cache, first)
    second = first[:8] + [99, 98, 97, 96, 95]
    hit = cache.lookup(cache.keys(second), len(second))
    assert hit.num_tokens == 8
    kv = torch.full((LAYERS, 2, len(second), HEADS, DIM), -1.0)
    cache.load(hit, kv)
    assert torch.equal(kv[:, :, :8], prompt_kv(first)[:, :, :8])
    assert bool((kv[:, :, 8:] == -1).all())
    cache.release(hit)
    assert cache.stats.hit_tokens == 0  # a look-up counts nothing until the prompt uses it
    cache.count_query(len(second), 8)
    assert cache.stats.hit_tokens == 8 and cache.stats.queried_tokens == len(second)


def test_a_whole_prompt_hit_leaves_its_last_token_to_compute():
    cache = make_cache(8)
    tokens = list(range(1, 9))  # exactly two blocks
    store_prompt(cache, tokens)
    hit = cache.lookup(cache.keys(tokens), len(tokens))
    assert hit.num_tokens == 4  # block 1 holds the last token, whose logits are needed
    cache.release(hit)


def test_a_miss_in_the_middle_ends_the_hit():
    cache = make_cache(8)
    store_prompt(cache, list(range(1, 13)))
    other = list(range(1, 5)) + [0, 0, 0, 0] + list(range(9, 14))
    hit = cache.lookup(cache.keys(other), len(other))
    assert hit.num_tokens == 4
    cache.release(hit)


def test_storing_a_cached_prefix_again_takes_no_block():
    cache = make_cache(8)
    assert cache.store(cache.keys(list(range(12))), prompt_kv(list(range(12)))) == 3
    assert cache.store(cache.keys(list(range(12))), prompt_kv(list(range(12)))) == 0
    assert cache.num_cached_blocks == 3 and cache.stats.stored_blocks == 3


def test_eviction_takes_the_least_recently_used_chain_tail_first():
    cache = make_cache(4)
    a = [1] * 8  # two blocks
    b = [2] * 8
    store_prompt(cache, a)
    store_prompt(cache, b)  # the pool is full: a (older), then b
    hit = cache.lookup(cache.keys(a + [0]), 9)  # touches a: b is now the least recently used
    cache.release(hit)
    store_prompt(cache, [3] * 4)  # needs one block: b's tail goes
    assert cache.stats.evicted_blocks == 1
    b_hit = cache.lookup(cache.keys(b + [0]), 9)
    assert b_hit.num_tokens == 4  # b's head survived its tail
    cache.release(b_hit)
    a_hit = cache.lookup(cache.keys(a + [0]), 9)
    assert a_hit.num_tokens == 8
    cache.release(a_hit)


def test_pinned_blocks_are_never_evicted_and_a_full_pinned_pool_stores_nothing():
    cache = make_cache(2)
    a = [1] * 8
    store_prompt(cache, a)
    hit = cache.lookup(cache.keys(a + [0]), 9)  # pins both blocks
    assert cache.store(cache.keys([2] * 8), prompt_kv([2] * 8)) == 0
    kv = torch.zeros(LAYERS, 2, 9, HEADS, DIM)
    cache.load(hit, kv)
    assert torch.equal(kv[:, :, :8], prompt_kv(a)[:, :, :8])  # still a's KV
    cache.release(hit)
    assert cache.store(cache.keys([2] * 8), prompt_kv([2] * 8)) == 2  # unpinned: evictable now
    assert cache.stats.evicted_blocks == 2


def test_reference_counts_two_holders_of_one_block():
    cache = make_cache(2)
    store_prompt(cache, [1] * 4)
    first = cache.lookup(cache.keys([1] * 5), 5)
    second = cache.lookup(cache.keys([1] * 5), 5)
    cache.release(first)
    assert cache.store(cache.keys([7] * 8), prompt_kv([7] * 8)) == 1  # the free block only: [1]*4 is held
    cache.release(second)
    assert cache.store(cache.keys([8] * 8), prompt_kv([8] * 8)) == 2  # now [1]*4 can go too
    assert cache.lookup(cache.keys([1] * 5), 5).num_tokens == 0


def test_salted_prompts_do_not_share_blocks():
    cache = make_cache(8)
    tokens = list(range(12))
    cache.store(cache.keys(tokens, "a"), prompt_kv(tokens))
    assert cache.lookup(cache.keys(tokens, "b"), 12).num_tokens == 0
    assert cache.lookup(cache.keys(tokens), 12).num_tokens == 0
    assert cache.lookup(cache.keys(tokens, "a"), 12).num_tokens == 8


def test_blocks_in_a_budget():
    assert prefix_cache_blocks(1, 1024, 16) == 64
    assert prefix_cache_blocks(0, 1024, 16) == 0


def test_storing_a_longer_chain_never_evicts_its_own_cached_head():
    cache = make_cache(4)
    first = list(range(1, 9))  # two blocks
    store_prompt(cache, first)
    store_prompt(cache, [9] * 8)  # fills the pool: first's blocks are now the oldest
    longer = first + [7] * 4  # first's two blocks, then one more
    assert cache.store(cache.keys(longer), prompt_kv(longer)) == 1
    hit = cache.lookup(cache.keys(longer + [0]), 13)
    assert hit.num_tokens == 12  # the whole chain survived: the other prompt's tail was evicted
    cache.release(hit)
