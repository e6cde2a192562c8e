"""Continuous batching: sequences join and leave the running batch at every step.

Blocks are reserved when a sequence's KV arrives: for its whole life (prompt +
max_tokens, capped at the context) when `reserve_ahead_tokens` is 0, else for
the prompt plus at most that many tokens, and the rest as it grows. A sequence
whose next token finds no free block makes room by preempting the youngest
running sequence (itself if it is the youngest): that one's blocks are freed and
its stream ends with Preempted, which the decode server reports as ABORTED so
the router moves the request elsewhere (request migration) with its tokens so far.
Admission waits for free blocks in either case.
"""

from __future__ import annotations

import collections

from distserve.engine.kv_cache import BlockAllocator, blocks_needed
from distserve.engine.sequence import Sequence


class Preempted(RuntimeError):
    """The sequence's blocks were taken for older sequences; it must continue elsewhere."""


class DecodeScheduler:
    def __init__(self, allocator: BlockAllocator, block_size: int, max_running: int, max_context: int,
                 reserve_ahead_tokens: int = 0):
        self.allocator = allocator
        self._reserve_ahead = reserve_ahead_tokens
        self._block_size = block_size
        self._max_running = max_running
        self._max_context = max_context
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.max_running_seen = 0
        self.num_preempted = 0

    def blocks_for_life(self, prompt_len: int, max_tokens: int) -> int:
        """Blocks a sequence holds at its longest: prompt + max_tokens, capped at the context."""
        return blocks_needed(min(prompt_len + max_tokens, self._max_context), self._block_size)

    def blocks_for(self, prompt_len: int, max_tokens: int) -> int:
        """Blocks reserved when a sequence arrives (see the module docstring)."""
        ahead = min(max_tokens, self._reserve_ahead) if self._reserve_ahead else max_tokens
        return blocks_needed(min(prompt_len + ahead, self._max_context), self._block_size)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[Sequence]:
        """Drops aborted sequences, admits waiting ones, returns the batch for this step."""
        for seq in [s for s in self.waiting if s.is_aborted]:
            self.waiting.remove(seq)
            self.allocator.free(seq.block_table)
        self._retire([s for s in self.running if s.is_aborted])
        while self.waiting and len(self.running) < self._max_running:
            self.running.append(self.waiting.popleft())
        self.max_running_seen = max(self.max_running_seen, len(self.running))
        self._grow()
        return list(self.running)

    def _grow(self) -> None:
        """Gives every running sequence room for the token this step writes (at position context_len),
        oldest first, preempting the youngest when no block is free."""
        for seq in list(self.running):  # running is in arrival order: oldest first
            if seq not in self.running:
                continue  # preempted for an older one
            missing = blocks_needed(seq.context_len + 1, self._block_size) - len(seq.block_table)
            while missing > 0 and not self.allocator.can_allocate(missing):
                victim = self._youngest_growing()  # seq itself grows, so there is one
                self._preempt(victim)
                if victim is seq:
                    break
            if missing > 0 and seq in self.running:
                seq.block_table.extend(self.allocator.allocate(missing))

    def _youngest_growing(self) -> Sequence:
        """The youngest running sequence without blocks for its whole life; those with them (e.g.
        preempted once and reserved in full since) are never preempted."""
        return next(s for s in reversed(self.running)
                    if len(s.block_table) < self.blocks_for_life(s.prompt_len, s.params.max_tokens))

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.allocator.free(seq.block_table)
        seq.block_table = []
        seq.is_aborted = True
        self.num_preempted += 1
        seq.outputs.put_nowait(Preempted(
            f"preempted after {seq.num_generated} tokens: KV cache full ({self.allocator.num_free} blocks free)"))

    def retire_finished(self) -> list[Sequence]:
        finished = [s for s in self.running if s.finish_reason is not None]
        self._retire(finished)
        return finished

    def _retire(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            self.running.remove(seq)
            self.allocator.free(seq.block_table)
