"""Reference-counted KV blocks and forking a sequence's table (n completions of one prompt)."""

from __future__ import annotations

import torch

from distserve.engine.kv_cache import BlockAllocator, PagedKvCache


def test_a_shared_block_returns_to_the_free_list_with_its_last_holder():
    allocator = BlockAllocator(4)
    blocks = allocator.allocate(2)
    allocator.share(blocks)
    allocator.share(blocks[:1])
    allocator.free(blocks)
    assert allocator.num_free == 2  # still held twice (block 0) and once (block 1)
    allocator.free(blocks)
    assert allocator.num_free == 3  # block 1's last holder is gone
    allocator.free(blocks[:1])
    assert allocator.num_free == 4


def test_free_wakes_waiters_only_when_a_block_is_released():
    allocator = BlockAllocator(2)
    wakeups = []
    allocator.on_free = lambda: wakeups.append(1)
    blocks = allocator.allocate(1)
    allocator.share(blocks)
    allocator.free(blocks)
    assert wakeups == []
    allocator.free(blocks)
    assert wakeups == [1]


def test_fork_shares_full_blocks_and_copies_the_partial_one():
    cache = PagedKvCache(num_layers=2, num_kv_heads=1, head_dim=2, num_blocks=8, block_size=4,
                         dtype=torch.float32, device="cpu")
    parent = cache.allocator.allocate(3)
    kv = torch.randn(2, 2, 10, 1, 2)  # 10 tokens: blocks 0 and 1 full, block 2 holds 2
    cache.write_prompt(parent, kv)
    own = cache.allocator.allocate(2)
    child = cache.fork_table(parent, 10, own)
    assert child[:2] == parent[:2] and child[2:] == own
    assert torch.equal(cache.gather([child], [10])[:, :, 0], kv)  # the child reads the same prompt KV
    cache.storage[:, :, own[0]] += 1  # the child writes its next token into its own copy...
    assert torch.equal(cache.gather([parent], [10])[:, :, 0], kv)  # ...never into the parent's block
    cache.allocator.free(parent)
    assert cache.allocator.num_used == 4  # the two shared blocks stay with the child
    cache.allocator.free(child)
    assert cache.allocator.num_used == 0


def test_fork_at_a_block_boundary_copies_nothing():
    cache = PagedKvCache(1, 1, 1, 4, 4, torch.float32, "cpu")
    parent = cache.allocator.allocate(2)
    cache.write_prompt(parent, torch.ones(1, 2, 8, 1, 1))
    own = cache.allocator.allocate(1)
    assert cache.fork_table(parent, 8, own) == parent + own
    assert torch.count_nonzero(cache.storage[:, :, own[0]]) == 0
