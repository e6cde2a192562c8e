"""DecodeScheduler: admission up to max_running, block reservation and release."""

from __future__ import annotations

import pytest

from distserve.engine.kv_cache import BlockAllocator
from distserve.request_types import FinishReason
from distserve.engine.decode_scheduler import DecodeScheduler
from tests.builders import decode_sequence

BLOCK_SIZE = 4
MAX_CONTEXT = 64
NUM_BLOCKS = 32


def make_scheduler(max_running: int = 2) -> DecodeScheduler:
    return DecodeScheduler(BlockAllocator(NUM_BLOCKS), BLOCK_SIZE, max_running, MAX_CONTEXT)


def add_sequences(scheduler: DecodeScheduler, count: int, prompt_len: int = 5, max_tokens: int = 6):
    """Reserves each sequence's blocks as the engine does when its KV arrives, then queues it."""
    seqs = []
    for i in range(count):
        blocks = scheduler.allocator.allocate(scheduler.blocks_for(prompt_len, max_tokens))
        seq = decode_sequence(f"r{i}", prompt_len, blocks, max_tokens=max_tokens)
        scheduler.add(seq)
        seqs.append(seq)
    return seqs


@pytest.mark.parametrize("prompt_len, max_tokens, expected", [
    (4, 4, 2), (5, 4, 3), (1, 0, 1), (60, 4, 16), (60, 100, 16), (63, 1000, 16),
])
def test_blocks_for_covers_prompt_and_completion_capped_at_context(prompt_len, max_tokens, expected):
    assert make_scheduler().blocks_for(prompt_len, max_tokens) == expected


def test_admits_in_arrival_order_up_to_max_running():
    scheduler = make_scheduler(max_running=2)
    seqs = add_sequences(scheduler, 3)
    assert scheduler.schedule() == seqs[:2]
    assert list(scheduler.waiting) == [seqs[2]]
    assert scheduler.schedule() == seqs[:2]  # full: nobody else joins
    assert scheduler.max_running_seen == 2


def test_retire_finished_frees_blocks_and_lets_the_next_join():
    scheduler = make_scheduler(max_running=2)
    seqs = add_sequences(scheduler, 3)
    scheduler.schedule()
    free_before = scheduler.allocator.num_free
    seqs[0].finish_reason = FinishReason.STOP

    assert scheduler.retire_finished() == [seqs[0]]
    assert scheduler.allocator.num_free == free_before + len(seqs[0].block_table)
    assert scheduler.retire_finished() == []
    assert scheduler.schedule() == [seqs[1], seqs[2]]


def test_aborted_waiting_sequence_is_dropped_and_its_blocks_freed():
    scheduler = make_scheduler(max_running=1)
    seqs = add_sequences(scheduler, 3)
    scheduler.schedule()
    seqs[2].is_aborted = True
    free_before = scheduler.allocator.num_free

    assert scheduler.schedule() == [seqs[0]]
    assert list(scheduler.waiting) == [seqs[1]]
    assert scheduler.allocator.num_free == free_before + len(seqs[2].block_table)


def test_aborted_running_sequence_leaves_the_batch_and_its_blocks_are_freed():
    scheduler = make_scheduler(max_running=2)
    seqs = add_sequences(scheduler, 3)
    scheduler.schedule()
    seqs[1].is_aborted = True
    free_before = scheduler.allocator.num_free

    assert scheduler.schedule() == [seqs[0], seqs[2]]
    assert scheduler.allocator.num_free == free_before + len(seqs[1].block_table)


def test_all_blocks_come_back_when_everything_ends():
    scheduler = make_scheduler(max_running=2)
    seqs = add_sequences(scheduler, 4)
    seqs[3].is_aborted = True
    while scheduler.has_work():
        for seq in scheduler.schedule():
            seq.finish_reason = FinishReason.LENGTH
        scheduler.retire_finished()
    assert scheduler.allocator.num_free == NUM_BLOCKS
    assert not scheduler.running and not scheduler.waiting


def test_schedule_returns_a_snapshot_of_the_batch():
    scheduler = make_scheduler()
    add_sequences(scheduler, 1)
    batch = scheduler.schedule()
    batch.clear()
    assert len(scheduler.running) == 1


def growing_scheduler(num_blocks: int, reserve_ahead: int = 2) -> DecodeScheduler:
    return DecodeScheduler(BlockAllocator(num_blocks), BLOCK_SIZE, 8, MAX_CONTEXT, reserve_ahead_tokens=reserve_ahead)


def advance(seq, count: int = 1) -> None:
    """As the engine does after a step: the sampled token joins the sequence."""
    seq.tokens.extend([7] * count)


def test_reserve_ahead_reserves_the_prompt_and_a_few_tokens_then_grows_a_block_at_a_time():
    scheduler = growing_scheduler(num_blocks=8)
    assert scheduler.blocks_for(5, 40) == 2  # 5 + 2 tokens, not 5 + 40
    assert scheduler.blocks_for_life(5, 40) == 12
    [seq] = add_sequences(scheduler, 1, prompt_len=5, max_tokens=40)
    assert len(seq.block_table) == 2
    for _ in range(6):  # context 5 -> 11: the step writing position 8 needs a third block
        scheduler.schedule()
        assert len(seq.block_table) * BLOCK_SIZE >= seq.context_len + 1
        advance(seq)
    assert len(seq.block_table) == 3 and scheduler.allocator.num_used == 3


async def test_a_full_cache_preempts_the_youngest_sequence_and_frees_its_blocks():
    scheduler = growing_scheduler(num_blocks=4)
    old, young = add_sequences(scheduler, 2, prompt_len=6, max_tokens=40)  # 6 + 2 tokens: 2 blocks each, all 4
    scheduler.schedule()
    advance(old, 2)  # context 8: old's next token needs a third block, none is free
    assert scheduler.schedule() == [old]
    assert young.is_aborted and young.block_table == [] and scheduler.num_preempted == 1
    assert "preempted after" in str(young.outputs.get_nowait())
    assert len(old.block_table) == 3 and scheduler.allocator.num_used == 3


def test_the_youngest_sequence_preempts_itself_when_it_alone_needs_room():
    scheduler = growing_scheduler(num_blocks=4)
    old, young = add_sequences(scheduler, 2, prompt_len=6, max_tokens=40)
    scheduler.schedule()
    advance(young, 2)
    assert scheduler.schedule() == [old]
    assert young.is_aborted and scheduler.allocator.num_used == 2 and len(old.block_table) == 2


def test_a_sequence_holding_blocks_for_its_whole_life_is_never_preempted():
    scheduler = growing_scheduler(num_blocks=5)
    [old] = add_sequences(scheduler, 1, prompt_len=6, max_tokens=40)  # 2 blocks, grows
    whole = scheduler.allocator.allocate(scheduler.blocks_for_life(6, 6))  # 3 blocks: 6 + 6 tokens
    migrated = decode_sequence("migrated", 6, whole, max_tokens=6)
    scheduler.add(migrated)
    scheduler.schedule()
    advance(old, 2)  # old needs a third block; the only younger sequence holds its whole life
    assert scheduler.schedule() == [migrated]
    assert old.is_aborted and not migrated.is_aborted
