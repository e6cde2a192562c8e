"""Full blocks of a paged KV cache by prefix key (distserve.prefix_hash): a sequence whose prompt starts
like one already in the cache shares those blocks, reference-counted, instead of holding copies (and
pulls only the rest of its KV). Decode attention then reads one copy of a shared system prompt for the
whole batch, which stays in the CPU's caches, instead of one copy per sequence from memory.

Listed are a prompt's full blocks once its KV is written, and a finished sequence's full blocks past
its prompt (the next turn of a conversation starts with that prompt and answer). A listed block stays
listed after its last holder frees it: the allocator keeps it cached, and only when it evicts it for
an allocation (`on_evict`) is it forgotten. Full blocks are never written again while listed, so a
listed block's KV stays what its key says. Event-loop only, like the allocator.
"""

from __future__ import annotations

from distserve.engine.kv_cache import BlockAllocator
from distserve.prefix_events import PAGED_CACHE, PrefixEventLog
from distserve.prefix_hash import longest_run


class SharedBlocks:
    def __init__(self, allocator: BlockAllocator):
        self._allocator = allocator
        self._block_of: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self.num_listed = 0  # blocks listed since start: grows on every add that lists one
        self.events: PrefixEventLog | None = None  # told what is listed and forgotten (the routers' index)
        allocator.keeps = self._key_of.__contains__  # a listed block stays cached when its last holder frees it
        allocator.on_evict = self._forget

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
        listed = []
        for key, block in zip(keys, blocks):
            if key not in self._block_of and block not in self._key_of:
                self._block_of[key], self._key_of[block] = block, key
                listed.append(key)
        self.num_listed += len(listed)
        if self.events is not None:
            self.events.stored(PAGED_CACHE, listed)

    def release(self, blocks: list[int]) -> None:
        """Drops the holder `take` added to each block."""
        self._allocator.free(blocks)

    def _forget(self, blocks: list[int]) -> None:
        forgotten = []
        for block in blocks:
            key = self._key_of.pop(block, None)
            if key is not None:
                del self._block_of[key]
                forgotten.append(key)
        if self.events is not None:
            self.events.evicted(PAGED_CACHE, forgotten)
