"""PagedPrefix: a colocated engine's prefill copies a chat's earlier turns, answers included, from its
paged cache, computes only the new message, and answers token for token as without the cache."""

from __future__ import annotations

import asyncio

import pytest

from distserve.engine.colocated_engine import ColocatedEngine
from distserve.engine.model_loader import load_engine_model
from distserve.engine.model_runner import ModelRunner
from distserve.engine.paged_prefix import PagedPrefix
from distserve.prefix_hash import PrefixNamespace
from tests.builders import colocated_engine, serve_colocated

BLOCK_SIZE = 16
NUM_BLOCKS = 64


@pytest.fixture(scope="module")
def model(tiny_model_path):
    return load_engine_model(tiny_model_path, "float32", "cpu")


def build(model, spec, shared: bool) -> ColocatedEngine:
    namespace = PrefixNamespace("tiny", "float32", BLOCK_SIZE) if shared else None
    return colocated_engine(ModelRunner(model), spec, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, prefix=namespace)


async def chat(engine: ColocatedEngine, first: list[int], reply: list[int]) -> tuple[list[int], int]:
    """Two turns: `first`, then first + its answer + `reply`; the second turn's tokens and cached tokens."""
    loop = asyncio.create_task(engine.run())
    try:
        answer, _ = await serve_colocated(engine, first, 40)
        return await serve_colocated(engine, first + answer + reply, 24)
    finally:
        loop.cancel()


async def test_the_next_turn_copies_the_last_prompt_and_answer_and_answers_as_without_the_cache(model, spec):
    first, reply = list(range(5, 45)), list(range(300, 310))  # 40-token prompt, 40-token answer, 10 new
    cached_answer, cached = await chat(build(model, spec, shared=True), first, reply)
    plain_answer, none_cached = await chat(build(model, spec, shared=False), first, reply)
    # the finished turn lists its full blocks: (40 + 40 tokens, less the last, unwritten) // 16 = 4 blocks
    assert (cached, none_cached) == (4 * BLOCK_SIZE, 0)
    assert cached_answer == plain_answer


async def test_a_pinned_block_survives_allocation_pressure_and_is_released_on_the_loop(model, spec):
    engine = build(model, spec, shared=True)
    decode, paged = engine.decode, engine.prefill.prefix_sources[-1]
    assert isinstance(paged, PagedPrefix)
    blocks = decode.scheduler.allocator.allocate(2)
    prompt = list(range(1, 34))  # 33 tokens: two full blocks
    keys = paged.keys(prompt)
    before = paged.version
    decode.shared_blocks.add(keys, blocks)
    assert paged.version == before + 2
    decode.scheduler.allocator.free(blocks)  # kept cached: listed
    pinned = paged.lookup(keys, len(prompt))
    assert pinned.blocks == blocks and pinned.num_tokens == 32
    taken = decode.scheduler.allocator.allocate(decode.scheduler.allocator.num_free)  # everything evictable
    assert not set(blocks) & set(taken)
    decode.scheduler.allocator.free(taken)
    await asyncio.to_thread(paged.release, pinned)  # from another thread: handed to the loop
    assert pinned.blocks == []
    await asyncio.sleep(0)  # the loop runs the release
    assert set(blocks) <= set(decode.scheduler.allocator.allocate(decode.scheduler.allocator.num_free))
