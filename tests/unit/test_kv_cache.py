"""BlockAllocator capacity checks and PagedKvCache scatter/gather against contiguous KV."""

from __future__ import annotations

import pytest
import torch

from distserve.engine.kv_cache import BlockAllocator, PagedKvCache, blocks_needed
from tests.builders import model_spec, random_kv

SPEC = model_spec(num_layers=2, num_kv_heads=3, head_dim=4)
BLOCK_SIZE = 4


def make_cache(num_blocks: int = 32) -> PagedKvCache:
    return PagedKvCache(SPEC.num_layers, SPEC.num_kv_heads, SPEC.head_dim, num_blocks, BLOCK_SIZE,
                        torch.float32, "cpu")


def shuffled_tables(cache: PagedKvCache, num_blocks_each: list[int]) -> list[list[int]]:
    """Tables whose blocks are interleaved and out of order, as after real alloc/free churn."""
    scratch = cache.allocator.allocate(cache.allocator.num_free)
    cache.allocator.free(scratch[::-1][::2] + scratch[::-1][1::2])
    return [cache.allocator.allocate(n) for n in num_blocks_each]


@pytest.mark.parametrize("num_tokens, expected", [(0, 0), (1, 1), (4, 1), (5, 2), (8, 2), (9, 3)])
def test_blocks_needed_rounds_up(num_tokens, expected):
    assert blocks_needed(num_tokens, BLOCK_SIZE) == expected


def test_allocate_hands_out_distinct_blocks_and_counts_them():
    allocator = BlockAllocator(8)
    first, second = allocator.allocate(3), allocator.allocate(5)
    assert len(first) == 3 and len(second) == 5
    assert sorted(first + second) == list(range(8))
    assert (allocator.num_free, allocator.num_used) == (0, 8)


def test_allocate_returns_none_when_full_and_changes_nothing():
    allocator = BlockAllocator(4)
    held = allocator.allocate(3)
    assert allocator.can_allocate(1) and not allocator.can_allocate(2)
    assert allocator.allocate(2) is None
    assert allocator.num_free == 1
    assert allocator.allocate(1) is not None
    assert allocator.allocate(1) is None
    assert len(held) == 3


def test_allocate_zero_blocks_is_empty():
    allocator = BlockAllocator(2)
    assert allocator.can_allocate(0)
    assert allocator.allocate(0) == []
    assert allocator.num_free == 2


def test_freed_blocks_can_be_allocated_again():
    allocator = BlockAllocator(6)
    a, b = allocator.allocate(4), allocator.allocate(2)
    allocator.free(a)
    assert allocator.num_free == 4 and allocator.can_allocate(4) and not allocator.can_allocate(5)
    again = allocator.allocate(4)
    assert sorted(again) == sorted(a)
    assert not set(again) & set(b)


def test_write_prompt_then_gather_round_trips_right_padded():
    cache = make_cache()
    lengths = [1, 4, 5, 11]  # partial block, exactly one block, spill by one, several blocks
    tables = shuffled_tables(cache, [blocks_needed(n, BLOCK_SIZE) + 1 for n in lengths])
    kvs = [random_kv(n, SPEC, seed=i) for i, n in enumerate(lengths)]
    for table, kv in zip(tables, kvs):
        cache.write_prompt(table, kv)

    out = cache.gather(tables, lengths)

    max_len = max(lengths)
    assert out.shape == (SPEC.num_layers, 2, len(lengths), max_len, SPEC.num_kv_heads, SPEC.head_dim)
    for b, (kv, n) in enumerate(zip(kvs, lengths)):
        assert torch.equal(out[:, :, b, :n], kv)
        assert torch.count_nonzero(out[:, :, b, n:]) == 0


def test_gather_of_a_subset_and_shorter_length():
    cache = make_cache()
    kv = random_kv(9, SPEC)
    (table,) = shuffled_tables(cache, [3])
    cache.write_prompt(table, kv)
    out = cache.gather([table], [6])
    assert torch.equal(out[:, :, 0], kv[:, :, :6])


def test_write_slots_appends_across_block_boundaries():
    cache = make_cache()
    prompt_lens, num_new = [3, 4, 7], 6
    tables = shuffled_tables(cache, [blocks_needed(n + num_new, BLOCK_SIZE) for n in prompt_lens])
    expected = [random_kv(n + num_new, SPEC, seed=10 + i) for i, n in enumerate(prompt_lens)]
    for table, kv, n in zip(tables, expected, prompt_lens):
        cache.write_prompt(table, kv[:, :, :n])

    for step in range(num_new):
        positions = [n + step for n in prompt_lens]
        slots = cache.slot_tensor(tables, positions)
        for layer in range(SPEC.num_layers):
            # k, v: [B, H, D]
            k = torch.stack([kv[layer, 0, p] for kv, p in zip(expected, positions)])
            v = torch.stack([kv[layer, 1, p] for kv, p in zip(expected, positions)])
            cache.write_slots(layer, slots, k, v)

    lengths = [n + num_new for n in prompt_lens]
    out = cache.gather(tables, lengths)
    for b, (kv, n) in enumerate(zip(expected, lengths)):
        assert torch.equal(out[:, :, b, :n], kv)


def test_block_table_tensor_pads_with_the_zero_pad_block():
    cache = make_cache()
    tables = shuffled_tables(cache, [3, 1])
    got = cache.block_table_tensor(tables, [9, 2])  # 9 tokens need 3 blocks, 2 need 1
    assert got.tolist() == [tables[0], tables[1] + [cache.pad_block] * 2]
    assert torch.count_nonzero(cache.layer(0)[:, cache.pad_block]) == 0


def test_sequences_do_not_overwrite_each_other():
    cache = make_cache()
    tables = shuffled_tables(cache, [2, 2])
    first, second = random_kv(8, SPEC, seed=1), random_kv(8, SPEC, seed=2)
    cache.write_prompt(tables[0], first)
    cache.write_prompt(tables[1], second)
    zeros = torch.zeros(1, SPEC.num_kv_heads, SPEC.head_dim)
    for layer in range(SPEC.num_layers):
        cache.write_slots(layer, cache.slot_tensor([tables[1]], [7]), zeros, zeros)
    assert torch.equal(cache.gather([tables[0]], [8])[:, :, 0], first)
    assert torch.count_nonzero(cache.gather([tables[1]], [8])[:, :, 0, 7]) == 0


def test_fill_random_writes_every_block_but_the_pad_block():
    cache = PagedKvCache(2, 2, 4, 3, 4, torch.float32, "cpu")
    cache.fill_random_(seed=1)
    for layer in range(2):
        blocks = cache.layer(layer)[:, :cache.pad_block]
        assert torch.count_nonzero(blocks) == blocks.numel()
        assert torch.count_nonzero(cache.layer(layer)[:, cache.pad_block]) == 0


def test_the_allocator_caches_kept_blocks_counts_them_free_and_evicts_tails_first():
    allocator = BlockAllocator(6)
    kept = set()
    evicted = []
    allocator.keeps, allocator.on_evict = kept.__contains__, evicted.extend
    table = allocator.allocate(4)
    kept.update(table[:3])  # three listed blocks; the fourth is not kept
    allocator.free(table)
    assert (allocator.num_cached, allocator.num_free, allocator.num_used) == (3, 6, 0)
    allocator.share([table[0]])  # revived: one holder, no longer cached
    assert allocator.num_cached == 2 and allocator.num_used == 1
    got = allocator.allocate(4)  # 3 on the free list, then the least recently released cached block
    assert evicted == [table[2]] and table[2] in got  # the tail went first
    assert allocator.num_cached == 1 and allocator.allocate(2) is None
