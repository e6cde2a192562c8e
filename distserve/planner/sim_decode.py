"""Simulated workers that decode: the disaggregated decode worker and the colocated worker.

Decode (decode_engine.py + decode_scheduler.py): reserving -> (KV transfer) -> waiting -> running.
  Blocks for prompt + output are reserved before the KV moves; a request that does not fit waits
  for frees. At each step boundary waiting sequences join (up to `max_running`), then every
  running sequence makes one token.
Colocated (engine/colocated_engine.py, vLLM-style chunked prefill): reserving -> prefilling ->
  waiting -> running, one loop. Blocks are reserved first, as on decode. Each step takes every
  running sequence (one row each), then prompt chunks chosen by the prefill batcher's policy under
  what the decode rows leave of the token budget. A prompt's first token is out at the end of the
  step that ran its last chunk; it joins the running batch at the next step boundary.
"""

from __future__ import annotations

import collections
from typing import Callable

from distserve.planner.profile import Profile, chunk_attn_pairs
from distserve.planner.sim_workers import (EventLoop, KvBlocks, SimRequest, step_seconds, take_prefill_batch,
                                          take_whole_prompts)

Callback = Callable[[SimRequest], None]


class RunningBatch:
    """Decoding sequences, each making one token per step.

    Bookkeeping is O(1) per step: the total context grows by the batch size, and each sequence is
    filed under the step at whose end it finishes. `num_generated` is brought up to date only then.
    """

    def __init__(self) -> None:
        self.size = 0
        self.context_sum = 0  # sum of context_len over running sequences, for the next step
        self._num_steps = 0
        self._finishing: dict[int, list[SimRequest]] = {}

    def add(self, req: SimRequest) -> None:
        """`req` (with its first token made) generates from the next step on."""
        last_step = self._num_steps + req.output_len - req.num_generated
        self._finishing.setdefault(last_step, []).append(req)
        self.context_sum += req.context_len
        self.size += 1

    def advance(self) -> list[SimRequest]:
        """One step ran; returns the sequences it finished (now out of the batch)."""
        self._num_steps += 1
        self.context_sum += self.size
        done = self._finishing.pop(self._num_steps, [])
        for req in done:
            req.num_generated = req.output_len
            self.context_sum -= req.context_len
        self.size -= len(done)
        return done


class DecodeSim:
    """A disaggregated decode worker."""

    def __init__(self, loop: EventLoop, profile: Profile, max_running: int, node: int, block_size: int,
                 on_finished: Callback):
        self.loop, self.profile, self.node = loop, profile, node
        self.max_running = max_running
        self.blocks = KvBlocks(profile.kv_capacity_tokens, block_size)
        self.num_assigned = 0  # routed here and not finished: the router's load figure
        self._on_finished = on_finished
        self._waiting: collections.deque[SimRequest] = collections.deque()
        self._running = RunningBatch()
        self._is_busy = False
        self.frontend_charge: Callable[[], float] = lambda: 0.0  # front-end seconds per decoding row this step

    @property
    def is_busy(self) -> bool:
        return self._is_busy

    def add(self, req: SimRequest) -> None:
        """`req`'s KV has arrived (its blocks are reserved): it joins at the next step boundary."""
        self._waiting.append(req)
        if not self._is_busy:
            self._start_step()

    def _start_step(self) -> None:
        while self._waiting and self._running.size < self.max_running:
            self._running.add(self._waiting.popleft())
        self._is_busy = self._running.size > 0
        if self._is_busy:
            seconds = step_seconds(self.profile, 0, 0, self._running.size, self._running.context_sum)
            self.loop.call_later(seconds + self._running.size * self.frontend_charge(), self._end_step)

    def _end_step(self) -> None:
        # _is_busy stays set through the callbacks, so an add() they cause waits for _start_step
        for req in self._running.advance():
            req.finish_s = self.loop.now
            self.num_assigned -= 1
            self.blocks.free(req)
            self._on_finished(req)
        self._start_step()


class ColocatedSim:
    """A colocated worker: prefill chunks and decode rows share each step (engine/colocated_engine.py).

    `chunked_prefill=False` models the engines before chunked prefill (vLLM up to 0.4, the DistServe
    paper's baseline): while prompts wait, a step prefills whole prompts only (take_whole_prompts) and
    every decoding sequence waits for it; otherwise the step decodes."""

    def __init__(self, loop: EventLoop, profile: Profile, max_batch_tokens: int, max_running: int, node: int,
                 block_size: int, on_first_token: Callback, on_finished: Callback, chunked_prefill: bool = True):
        self.chunked_prefill = chunked_prefill
        self.loop, self.profile, self.node = loop, profile, node
        self.max_batch_tokens, self.max_running = max_batch_tokens, max_running
        self.blocks = KvBlocks(profile.kv_capacity_tokens, block_size)
        self.outstanding_tokens = 0  # prompt tokens routed here, not yet prefilled: the router's load figure
        self._on_first_token, self._on_finished = on_first_token, on_finished
        self._prompts: list[SimRequest] = []  # blocks reserved, prompt not fully prefilled
        self._waiting: collections.deque[SimRequest] = collections.deque()  # prefilled, to join decoding
        self._running = RunningBatch()
        self._is_busy = False
        self.frontend_charge: Callable[[], float] = lambda: 0.0  # front-end seconds per decoding row this step

    @property
    def is_busy(self) -> bool:
        return self._is_busy

    @property
    def num_running(self) -> int:
        return self._running.size

    def submit(self, req: SimRequest) -> None:
        """Reserves the request's blocks (waiting for frees if need be), then queues its prompt."""
        self.outstanding_tokens += req.input_len
        self.blocks.reserve(req, lambda: self._queue_prompt(req))

    def _queue_prompt(self, req: SimRequest) -> None:
        self._prompts.append(req)
        if not self._is_busy:
            self._start_step()

    def _start_step(self) -> None:
        while self._waiting and self._running.size < self.max_running:
            self._running.add(self._waiting.popleft())
        if self.chunked_prefill:  # decoding rows go first and ride on top of the prompts' budget (ColocatedEngine.run)
            chunks, decodes = take_prefill_batch(self._prompts, self.max_batch_tokens), True
        else:  # a prefill-only step while prompts wait and sequences may join, else a decode-only one
            room = self.max_running - self._running.size - len(self._waiting)
            chunks = take_whole_prompts(self._prompts, self.max_batch_tokens, room) if room > 0 else []
            decodes = not chunks
        num_decode = self._running.size if decodes else 0
        self._is_busy = bool(chunks) or num_decode > 0
        if self._is_busy:
            tokens = sum(n for _, n in chunks)
            attn = sum(chunk_attn_pairs(n, req.num_computed) for req, n in chunks)
            seconds = step_seconds(self.profile, tokens, attn, num_decode, self._running.context_sum if decodes else 0)
            seconds += num_decode * self.frontend_charge()
            self.loop.call_later(seconds, self._end_step, chunks, decodes)

    def _end_step(self, chunks: list[tuple[SimRequest, int]], decodes: bool = True) -> None:
        # _is_busy stays set through the callbacks, so a prompt they queue waits for _start_step
        for req in (self._running.advance() if decodes else ()):
            self._finish(req)
        for req, n in chunks:
            req.num_computed += n
            self.outstanding_tokens -= n
        for req in [r for r, _ in chunks if r.num_remaining == 0]:
            req.first_token_s, req.num_generated = self.loop.now, 1
            self._on_first_token(req)
            if req.output_len <= 1:
                self._finish(req)
            else:
                self._waiting.append(req)  # handed to the decode side: joins at the next step
        self._start_step()

    def _finish(self, req: SimRequest) -> None:
        req.finish_s = self.loop.now
        self.blocks.free(req)
        self._on_finished(req)
