"""Regression tests for defects found in review: tiny temperatures, block waits, EOS from generation config."""

from __future__ import annotations

import asyncio
import types

import torch

from distserve.model_spec import ModelSpec
from distserve.engine.sampling import sample_token
from distserve.request_types import SamplingParams
from tests.builders import engine_with_blocks


def test_tiny_temperature_samples_greedily_instead_of_failing():
    logits = torch.tensor([0.1, 2.0, 0.3])
    for temperature in (1e-39, 1e-300, 1e-6):
        params = SamplingParams(temperature=temperature, seed=1)
        assert params.is_greedy
        assert sample_token(logits, params, 0, []) == 1
    assert not SamplingParams(temperature=1e-4).is_greedy


async def test_a_block_wait_wakes_as_soon_as_blocks_are_freed_outside_the_engine():
    engine = engine_with_blocks(4)
    held = engine.scheduler.allocator.allocate(4)
    waiter = asyncio.ensure_future(engine.reserve(3))
    await asyncio.sleep(0.05)
    assert not waiter.done()
    engine.scheduler.allocator.free(held[:2])  # e.g. a request whose transfer failed gives its blocks back
    await asyncio.sleep(0.05)
    assert not waiter.done(), "2 free blocks are not enough for 3"
    engine.scheduler.allocator.free(held[2:])
    blocks = await asyncio.wait_for(waiter, 1.0)
    assert len(blocks) == 3 and engine.scheduler.allocator.num_free == 1


def test_eos_ids_include_the_generation_configs():
    config = types.SimpleNamespace(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   hidden_size=64, vocab_size=100, max_position_embeddings=128, eos_token_id=7)
    generation = types.SimpleNamespace(eos_token_id=[7, 9])
    assert ModelSpec.from_config(config, generation).eos_token_ids == (7, 9)
    assert ModelSpec.from_config(config).eos_token_ids == (7,)
