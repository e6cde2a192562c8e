"""ColocatedEngine on the real tiny model: fused steps, and the same tokens as prefill-then-decode alone."""

from __future__ import annotations

import asyncio

import pytest

from distserve.engine.colocated_engine import ColocatedEngine
from distserve.engine.model_loader import load_engine_model
from distserve.engine.model_runner import ModelRunner
from tests.builders import colocated_engine, serve_colocated

BLOCK_SIZE = 16
BUDGET = 32  # small, so a long prompt is chunked beside the decoding sequences


class CountingRunner(ModelRunner):
    """Records the shape of every step: (prompt tokens, decoding sequences)."""

    def __init__(self, model):
        super().__init__(model)
        self.shapes: list[tuple[int, int]] = []

    def step(self, works, decode):
        self.shapes.append((sum(len(w.token_ids) for w in works), len(decode.input_ids) if decode else 0))
        return super().step(works, decode)


@pytest.fixture(scope="module")
def model(tiny_model_path):
    return load_engine_model(tiny_model_path, "float32", "cpu")


def build(model, spec) -> tuple[ColocatedEngine, CountingRunner]:
    runner = CountingRunner(model)
    return colocated_engine(runner, spec, block_size=BLOCK_SIZE, token_budget=BUDGET), runner


async def run_concurrently(engine: ColocatedEngine, requests: list[tuple[list[int], int, float]]):
    loop = asyncio.create_task(engine.run())

    async def delayed(prompt, max_tokens, delay_s):
        await asyncio.sleep(delay_s)
        return (await serve_colocated(engine, prompt, max_tokens))[0]

    try:
        return await asyncio.gather(*(delayed(*r) for r in requests))
    finally:
        loop.cancel()


async def test_prompt_chunks_ride_along_decode_steps_and_tokens_match_alone(model, spec):
    short, long = list(range(5, 12)), list(range(20, 120))  # 100 tokens: 4 chunks under a 32-token budget
    engine, runner = build(model, spec)
    together = await run_concurrently(engine, [(short, 30, 0.0), (long, 5, 0.0)])
    mixed = [(p, d) for p, d in runner.shapes if p and d]
    assert mixed, runner.shapes  # the long prompt was prefilled inside the short one's decode steps
    assert all(p <= BUDGET for p, _ in runner.shapes)  # decode rows ride on top of the prompt budget
    alone = [await run_concurrently(build(model, spec)[0], [(prompt, n, 0.0)]) for prompt, n in ((short, 30),
                                                                                                 (long, 5))]
    assert together == [alone[0][0], alone[1][0]]
    assert engine.decode.scheduler.allocator.num_used == 0


async def test_a_prompt_of_exactly_the_budget_is_one_forward_beside_decoding_sequences(model, spec):
    # counted against the budget, the decoding row split it into 31 + 1 tokens over two forwards
    short, exact = list(range(5, 12)), list(range(20, 20 + BUDGET))
    engine, runner = build(model, spec)
    await run_concurrently(engine, [(short, 100, 0.0), (exact, 5, 0.02)])
    prompt_steps = [(p, d) for p, d in runner.shapes if p]
    assert (BUDGET, 1) in prompt_steps, runner.shapes
    assert [p for p, _ in prompt_steps] == [len(short), BUDGET], runner.shapes
