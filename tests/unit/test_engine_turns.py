"""The engines compute only inside their worker's turn at the cores (distserve.engine.core_turns), on
their one compute thread."""

from __future__ import annotations

import asyncio
import contextlib
import threading

from distserve.request_types import SamplingParams
from tests.builders import decode_sequence, engine_with_blocks
from tests.unit.test_prefill_batcher import FakeRunner, make_batcher, prompt, run_batcher


class RecordingTurns:
    """Counts turns and knows whether one is in progress."""

    def __init__(self) -> None:
        self.inside = False
        self.num_turns = 0

    @contextlib.contextmanager
    def turn(self):
        self.inside, self.num_turns = True, self.num_turns + 1
        try:
            yield
        finally:
            self.inside = False


async def test_every_prefill_forward_runs_inside_a_turn_on_one_thread():
    turns, seen = RecordingTurns(), []

    class Runner(FakeRunner):
        def prefill_chunks(self, works):
            seen.append((turns.inside, threading.get_ident()))
            return super().prefill_chunks(works)

    batcher = make_batcher(Runner(), budget=4)
    batcher.turns = turns
    params = SamplingParams(temperature=0.0, max_tokens=4)
    results = await run_batcher(batcher, [(prompt(10 + i, 4), params) for i in range(3)])
    assert [r.first_token for r in results] == [11, 12, 13]
    assert [inside for inside, _ in seen] == [True] * 3 and turns.num_turns == 3
    assert len({thread for _, thread in seen}) == 1 and not turns.inside


async def test_every_decode_step_runs_inside_a_turn_on_one_thread():
    engine, turns, seen = engine_with_blocks(16), RecordingTurns(), []
    engine.turns = turns

    def forward_and_sample(batch):
        seen.append((turns.inside, threading.get_ident()))
        return [7] * len(batch), [None] * len(batch)

    engine._forward_and_sample = forward_and_sample
    # decode_sequence holds the first token already: 3 steps left
    seq = decode_sequence(block_table=engine.scheduler.allocator.allocate(4), max_tokens=4)
    engine.add(seq)
    loop_task = asyncio.create_task(engine.run())
    try:
        outputs = [await asyncio.wait_for(seq.outputs.get(), 10) for _ in range(3)]
    finally:
        loop_task.cancel()
        await asyncio.gather(loop_task, return_exceptions=True)
    assert [tokens for tokens, _, _ in outputs] == [[7], [7], [7]]
    assert [inside for inside, _ in seen] == [True] * 3 and turns.num_turns == 3
    assert len({thread for _, thread in seen}) == 1 and seen[0][1] != threading.get_ident()
