"""Decode-side sharing of full prompt blocks: a sequence whose prompt starts like one already in the
paged cache takes those blocks (reference-counted) instead of writing copies, frees the blocks it had
reserved for them, and reads exactly the KV it would have written; a block leaves the index with its
last holder."""

from __future__ import annotations

import asyncio

import torch

from distserve.engine.decode_engine import DecodeEngine
from distserve.engine.decode_scheduler import DecodeScheduler
from distserve.engine.kv_cache import PagedKvCache
from distserve.request_types import SamplingParams
from distserve.engine.sequence import Sequence
from distserve.prefix_hash import PrefixNamespace

BLOCK = 4


def engine(shared: bool = True) -> DecodeEngine:
    cache = PagedKvCache(num_layers=2, num_kv_heads=1, head_dim=2, num_blocks=16, block_size=BLOCK,
                         dtype=torch.float32, device="cpu")
    scheduler = DecodeScheduler(cache.allocator, block_size=BLOCK, max_running=8, max_context=1024)
    prefix = PrefixNamespace("m", "float32", BLOCK) if shared else None
    return DecodeEngine(None, cache, scheduler, eos_ids=(), max_context=1024, prefix=prefix)


def sequence(tokens: list[int], table: list[int], salt: str = "") -> Sequence:
    return Sequence("r", list(tokens), len(tokens) - 1, SamplingParams(cache_salt=salt), table, asyncio.Queue())


def kv_of(tokens: list[int]) -> torch.Tensor:
    """KV [L, 2, T, 1, 2] whose values name each token and position."""
    values = torch.tensor([t * 100.0 + p for p, t in enumerate(tokens)])
    return values[None, None, :, None, None].expand(2, 2, len(tokens), 1, 2).clone()


def loaded(e: DecodeEngine, tokens: list[int], salt: str = "", pull_only_the_rest: bool = False) -> tuple[Sequence, int]:
    """A sequence with the prompt's KV written: all of it handed over, or (pull_only_the_rest) only the
    tokens from the shared prefix on, as a decode worker pulls a handle's suffix."""
    seq = sequence(tokens + [0], e.scheduler.allocator.allocate(4), salt)  # 4 blocks: 16 tokens of room
    shared = e.share_cached_prefix(seq, len(tokens))
    kv_start = shared if pull_only_the_rest else 0
    e.load_prompt(seq, kv_of(tokens)[:, :, kv_start:], kv_start=kv_start, shared_tokens=shared)
    return seq, shared


def test_a_second_sequence_shares_the_full_blocks_of_a_common_prefix_and_frees_its_own():
    e = engine()
    first, shared_first = loaded(e, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])  # blocks 0, 1 full; 2 partial
    assert shared_first == 0 and e.shared_blocks.num_blocks == 2
    used = e.scheduler.allocator.num_used
    second, shared_second = loaded(e, [1, 2, 3, 4, 5, 6, 7, 8, 11, 12, 13])
    assert shared_second == 2 * BLOCK
    assert second.block_table[:2] == first.block_table[:2] and second.block_table[2] != first.block_table[2]
    assert e.scheduler.allocator.num_used == used + 4 - 2  # its two reserved copies went back
    for seq, tokens in ((first, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]), (second, [1, 2, 3, 4, 5, 6, 7, 8, 11, 12, 13])):
        assert torch.equal(e.kv_cache.gather([seq.block_table], [len(tokens)])[:, :, 0], kv_of(tokens))


def test_a_freed_block_stays_cached_and_shareable_until_an_allocation_evicts_it():
    e = engine()
    allocator = e.scheduler.allocator
    first, _ = loaded(e, list(range(1, 9)))
    second, shared = loaded(e, list(range(1, 9)) + [50])
    assert shared == 2 * BLOCK
    allocator.free(first.block_table)
    allocator.free(second.block_table)
    assert allocator.num_used == 0 and allocator.num_cached == 2 and e.shared_blocks.num_blocks == 2
    third, shared = loaded(e, list(range(1, 9)) + [60])
    assert shared == 2 * BLOCK  # revived from the cache
    assert torch.equal(e.kv_cache.gather([third.block_table], [9])[:, :, 0], kv_of(list(range(1, 9)) + [60]))
    allocator.free(third.block_table)
    allocator.allocate(allocator.num_blocks)  # everything: the cached blocks are evicted and forgotten
    assert allocator.num_cached == 0 and e.shared_blocks.num_blocks == 0


def test_a_finished_sequence_leaves_its_answer_blocks_for_the_next_turn():
    """A conversation's next prompt is the last prompt, its answer and a new message: once the answer's
    sequence is freed, its full blocks past the prompt are shared as well as the prompt's."""
    e = engine()
    prompt = [1, 2, 3, 4, 5, 6]
    seq, _ = loaded(e, prompt)
    seq.tokens = prompt + [7, 8, 9, 10, 11]  # 5 tokens generated; the KV of all but the last is written
    e.kv_cache.write_tokens(seq.block_table, kv_of(seq.tokens[:10])[:, :, 6:], first=6)
    seq.finish_reason = "length"
    e._list_generated_blocks(seq)
    e.scheduler.allocator.free(seq.block_table)
    next_turn, shared = loaded(e, seq.tokens + [12, 13])
    assert shared == 2 * BLOCK  # tokens 0-7: block 0 from the prompt, block 1 from the answer
    assert torch.equal(e.kv_cache.gather([next_turn.block_table], [13])[:, :, 0], kv_of(seq.tokens + [12, 13]))


def test_other_salts_and_other_positions_share_nothing():
    e = engine()
    loaded(e, list(range(1, 9)), salt="a")
    assert loaded(e, list(range(1, 9)), salt="b")[1] == 0
    assert loaded(e, [0] + list(range(1, 9)))[1] == 0  # the same tokens one position later
    assert loaded(e, list(range(1, 9)), salt="a")[1] == 2 * BLOCK


def test_without_a_namespace_every_sequence_writes_its_own():
    e = engine(shared=False)
    first, _ = loaded(e, list(range(1, 9)))
    second, shared = loaded(e, list(range(1, 9)))
    assert shared == 0 and not set(first.block_table) & set(second.block_table)


def test_the_engine_builder_and_its_accounting():
    from distserve.engine.decode_engine import build_decode_engine
    from tests.builders import model_spec

    spec = model_spec(max_context=64, num_layers=2, num_kv_heads=1, head_dim=2)  # kv_of's shape
    e = build_decode_engine(None, spec, "float32", "cpu", block_size=BLOCK, kv_cache_mb=1, max_running=4,
                            prefix=PrefixNamespace("m", "float32", BLOCK))
    total = e.usage().num_blocks
    assert e.usage().num_used_blocks == 0 and e.usage().num_free_blocks == total and e.shared_blocks is not None
    assert e.fork_blocks(prompt_len=10, max_tokens=6) == 4 - 2  # 16 tokens: 4 blocks, 2 full prompt blocks shared
    parent, _ = loaded(e, list(range(1, 11)))
    child = sequence(list(range(1, 11)) + [0], e.scheduler.allocator.allocate(e.fork_blocks(10, 6)))
    e.fork(parent, 10, child)
    assert child.block_table[:2] == parent.block_table[:2]
    e.release(parent)
    e.release(child)
    assert e.usage().num_used_blocks == 0


def test_a_suffix_written_after_its_shared_prefix_reads_back_as_the_whole_prompt():
    e = engine()
    first, _ = loaded(e, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    second, shared = loaded(e, [1, 2, 3, 4, 5, 6, 7, 8, 20, 21, 22, 23, 24], pull_only_the_rest=True)
    assert shared == 2 * BLOCK
    assert torch.equal(e.kv_cache.gather([second.block_table], [13])[:, :, 0],
                       kv_of([1, 2, 3, 4, 5, 6, 7, 8, 20, 21, 22, 23, 24]))
    third, shared = loaded(e, [1, 2, 3, 4, 5, 6, 7, 8, 20, 21, 22, 23, 30], pull_only_the_rest=True)
    assert shared == 3 * BLOCK  # the suffix's full block was listed too


def test_a_prefix_taken_before_reserving_survives_a_full_cache():
    """The decode server takes a prompt's cached prefix first and reserves only the rest: reserving
    first would have evicted the very blocks it was about to share."""
    e = engine()
    allocator = e.scheduler.allocator
    first, _ = loaded(e, list(range(1, 9)))
    allocator.free(first.block_table)
    hog = allocator.allocate(allocator.num_free - allocator.num_cached)  # every block but the 2 cached
    assert allocator.num_cached == 2 and allocator.num_free == 2
    seq = sequence(list(range(1, 9)) + [70, 0], [])
    assert e.share_cached_prefix(seq, 9) == 2 * BLOCK and len(seq.block_table) == 2
    assert allocator.num_free == 0  # revived, not evicted
    allocator.free(hog)
    seq.block_table += allocator.allocate(1)
    e.load_prompt(seq, kv_of(list(range(1, 9)) + [70])[:, :, 8:], kv_start=8, shared_tokens=8)
    assert torch.equal(e.kv_cache.gather([seq.block_table], [9])[:, :, 0], kv_of(list(range(1, 9)) + [70]))


async def test_a_reservation_counts_the_blocks_a_sequence_shares_already():
    e = engine()
    assert len(await e.reserve_for(prompt_len=8, max_tokens=8, timeout_s=1.0)) == 4  # 16 tokens
    assert len(await e.reserve_for(prompt_len=8, max_tokens=8, timeout_s=1.0, held_blocks=3)) == 1
    assert await e.reserve_for(prompt_len=8, max_tokens=8, timeout_s=1.0, held_blocks=4) == []
