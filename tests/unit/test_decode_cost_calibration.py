"""DecodeEngine.calibrate_cost: timed start-up steps give the cost meter its prior."""

from __future__ import annotations

import pytest
import torch

from distserve.engine.decode_engine import CALIBRATION_CONTEXT, DecodeEngine
from distserve.engine.decode_scheduler import DecodeScheduler
from distserve.engine.kv_cache import PagedKvCache, blocks_needed
from distserve.engine.model_loader import load_engine_model
from distserve.engine.model_runner import ModelRunner

BLOCK_SIZE = 16
PER_SEQ = blocks_needed(CALIBRATION_CONTEXT + 1, BLOCK_SIZE)


@pytest.fixture(scope="module")
def runner(tiny_model_path):
    return ModelRunner(load_engine_model(tiny_model_path, "float32", "cpu"))


def engine(runner: ModelRunner, num_blocks: int) -> DecodeEngine:
    a = runner.model.args
    cache = PagedKvCache(a.num_layers, a.num_kv_heads, a.head_dim, num_blocks, BLOCK_SIZE, torch.float32, "cpu")
    scheduler = DecodeScheduler(cache.allocator, BLOCK_SIZE, 8, 1024)
    return DecodeEngine(runner, cache, scheduler, eos_ids=(), max_context=1024)


def test_calibration_sets_a_step_line_and_gives_back_every_block(runner):
    calibrated = engine(runner, num_blocks=4 * PER_SEQ)  # room for batch 4 of the calibration's 32
    calibrated.calibrate_cost()
    cost = calibrated.cost
    assert cost.fixed > 0 or cost.per_unit > 0
    assert cost.seconds(4) >= cost.seconds(1) > 0
    assert calibrated.kv_cache.allocator.num_free == 4 * PER_SEQ


def test_a_cache_too_small_for_two_batch_sizes_leaves_the_cost_unmeasured(runner):
    small = engine(runner, num_blocks=2 * PER_SEQ - 1)  # one calibration sequence fits, two do not
    small.calibrate_cost()
    assert (small.cost.fixed, small.cost.per_unit) == (0.0, 0.0)
    assert small.kv_cache.allocator.num_free == 2 * PER_SEQ - 1
