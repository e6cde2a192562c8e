"""Continuous batching: sequences join and leave the running batch at every step.

Blocks for a sequence's whole life (prompt + max_tokens, capped at the context)
are reserved when its KV arrives, so a running sequence never runs out of
space mid-stream; admission waits for free blocks instead. Preemption can
replace the up-front reservation later without changing the engine.
"""

from __future__ import annotations

import collections

from distserve.engine.kv_cache import BlockAllocator, blocks_needed
from distserve.engine.sequence import Sequence


class DecodeScheduler:
    def __init__(self, allocator: BlockAllocator, block_size: int, max_running: int, max_context: int):
        self.allocator = allocator
        self._block_size = block_size
        self._max_running = max_running
        self._max_context = max_context
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.max_running_seen = 0

    def blocks_for(self, prompt_len: int, max_tokens: int) -> int:
        return blocks_needed(min(prompt_len + max_tokens, self._max_context), self._block_size)

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
        return list(self.running)

    def retire_finished(self) -> list[Sequence]:
        finished = [s for s in self.running if s.finish_reason is not None]
        self._retire(finished)
        return finished

    def _retire(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            self.running.remove(seq)
            self.allocator.free(seq.block_table)
