"""Full prompt blocks of the sequences in a paged KV cache, by prefix key (distserve.prefix_hash): a
sequence whose prompt starts like one already in the cache shares those blocks, reference-counted,
instead of holding copies. Decode attention then reads one copy of a shared system prompt for the whole
batch, which stays in the CPU's caches, instead of one copy per sequence from memory.

A block is listed from when its KV is written until its last holder frees it (the allocator's
`on_release`). Full prompt blocks are never written again, so a listed block's KV stays what its key
says. Event-loop only, like the allocator.
"""

from __future__ import annotations

from distserve.engine.kv_cache import BlockAllocator
from distserve.prefix_hash import longest_run


class SharedBlocks:
    def __init__(self, allocator: BlockAllocator):
        self._allocator = allocator
        self._block_of: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        allocator.on_release = self._forget

    @property
    def num_blocks(self) -> int:
        return len(self._block_of)

    def take(self, keys: list[bytes]) -> list[int]:
        """The listed blocks of the longest run of `keys` from the first, each with one more holder (the
        caller frees them once, as its own)."""
        blocks = longest_run(keys, self._block_of)
        self._allocator.share(blocks)
        return blocks

    def add(self, keys: list[bytes], blocks: list[int]) -> None:
        """Lists blocks whose KV is written, keys[i] for blocks[i]; a key listed already keeps its block."""
        for key, block in zip(keys, blocks):
            if key not in self._block_of and block not in self._key_of:
                self._block_of[key], self._key_of[block] = block, key

    def _forget(self, blocks: list[int]) -> None:
        for block in blocks:
            key = self._key_of.pop(block, None)
            if key is not None:
                del self._block_of[key]
