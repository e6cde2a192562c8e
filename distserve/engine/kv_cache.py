"""Paged KV cache: fixed-size blocks in one preallocated tensor, a block table per sequence.

Storage layout (one tensor for the whole worker):
    storage: [num_layers, 2 (key, value), num_blocks + 1, block_size, num_kv_heads, head_dim]
(token-major inside a block, so a sequence's slots gather with one index_select).

A sequence's token at position p lives in block `table[p // block_size]`, slot
`p % block_size`. The allocator hands out block ids; capacity checks are
`can_allocate()` / `allocate()` pairs, never exceptions on the hot path.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import torch

from distserve.engine import host_memory


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def blocks_in_budget(budget_mb: int, kv_bytes_per_token: int, block_size: int) -> int:
    """KV blocks a worker's paged cache gets from `budget_mb` MiB (at least one)."""
    return max(1, budget_mb * 1024 * 1024 // (kv_bytes_per_token * block_size))


class BlockAllocator:
    """Free list of block ids, with reference counts for blocks several sequences share (n completions
    of one prompt, a common prompt prefix), and a cache of unreferenced blocks worth keeping: a block
    whose last holder frees it while `keeps(block)` says so (its KV is listed by prefix key) stays
    cached, in LRU order, until an allocation needs it (`on_evict` is told) or `share` revives it.
    Cached blocks count as free. Not thread-safe: the owning event loop serialises calls."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self._cached: collections.OrderedDict[int, None] = collections.OrderedDict()  # least recent first
        self._extra_refs: dict[int, int] = {}  # block -> holders beyond the first (absent: one holder)
        self.on_free = lambda: None  # called after every free(), e.g. to wake requests waiting for blocks
        self.keeps: Callable[[int], bool] = lambda block: False  # whether a released block stays cached
        self.on_evict: Callable[[list[int]], None] = lambda blocks: None  # cached blocks handed out again

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._cached)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int] | None:
        """Returns n block ids, or None when fewer than n are free; evicts cached blocks, least recently
        released first, only when the free list runs short."""
        if not self.can_allocate(n):
            return None
        evicted = [self._cached.popitem(last=False)[0] for _ in range(n - len(self._free))]
        if evicted:
            self.on_evict(evicted)
            self._free.extend(evicted)
        return [self._free.pop() for _ in range(n)]

    def share(self, blocks: list[int]) -> None:
        """One more holder for each of these blocks (allocated, or cached: revived with one holder); each
        holder frees them once."""
        for block in blocks:
            if block in self._cached:
                del self._cached[block]
            else:
                self._extra_refs[block] = self._extra_refs.get(block, 0) + 1

    def free(self, blocks: list[int]) -> None:
        """Drops one holder of each block; a block is released with its last holder: cached if `keeps`
        says so, else back to the free list. A table's tail is released first, so that a cached prefix
        loses its tail, the part least likely to be shared, before its head."""
        released = False
        for block in reversed(blocks):
            extra = self._extra_refs.get(block, 0)
            if extra:
                if extra == 1:
                    del self._extra_refs[block]
                else:
                    self._extra_refs[block] = extra - 1
                continue
            released = True
            if self.keeps(block):
                self._cached[block] = None
            else:
                self._free.append(block)
        if released:
            self.on_free()


class PagedKvCache:
    """The block storage plus the writes into it and the block-table tensors attention reads.

    Token slots are numbered block * block_size + offset; one extra block past the
    allocator's range stays zero and serves as padding (`pad_block`).
    """

    def __init__(self, num_layers, num_kv_heads, head_dim, num_blocks, block_size, dtype, device):
        self.block_size = block_size
        # storage: [L, 2, num_blocks + 1, block_size, H, D]; the last block is the zero pad block
        shape = (num_layers, 2, num_blocks + 1, block_size, num_kv_heads, head_dim)
        if torch.device(device).type == "cpu":
            self.storage = host_memory.zeros(shape, dtype)  # huge pages: attention reads blocks scattered
        else:
            self.storage = torch.zeros(shape, dtype=dtype, device=device)
        self.allocator = BlockAllocator(num_blocks)
        self.pad_block = num_blocks

    @property
    def device(self) -> torch.device:
        return self.storage.device

    @property
    def _slots_view(self) -> torch.Tensor:
        """storage as [L, 2, total_slots, H, D]."""
        num_layers, _, num_blocks, bs, heads, head_dim = self.storage.shape
        return self.storage.view(num_layers, 2, num_blocks * bs, heads, head_dim)

    def fill_random_(self, seed: int = 0) -> None:
        """Fills every block but the pad block with normal noise, for profiles and benchmarks: their
        steps must read memory as a served cache's do. Untouched storage maps the kernel's one zero
        page, so attention would read from L1 and look several times cheaper than it is."""
        generator = torch.Generator(device=self.device).manual_seed(seed)
        self.storage[:, :, :self.pad_block].normal_(generator=generator)

    def layer(self, layer: int) -> torch.Tensor:
        """One layer's blocks: [2, num_blocks + 1, block_size, H, D] (a view)."""
        return self.storage[layer]

    def slot_tensor(self, tables: list[list[int]], positions: list[int]) -> torch.Tensor:
        """Slot of position positions[b] of sequence b: [B] (long, on the cache's device)."""
        bs = self.block_size
        return torch.tensor([t[p // bs] * bs + p % bs for t, p in zip(tables, positions)], device=self.device)

    def block_table_tensor(self, tables: list[list[int]], num_tokens: list[int]) -> torch.Tensor:
        """[B, max_blocks] block ids covering num_tokens[b] tokens of each sequence, padded with pad_block."""
        counts = [blocks_needed(n, self.block_size) for n in num_tokens]
        width = max(counts)
        rows = [table[:n] + [self.pad_block] * (width - n) for table, n in zip(tables, counts)]
        return torch.tensor(rows, dtype=torch.long, device=self.device)

    def write_slots(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Writes one layer's K/V of new tokens in place. slots: [N]; k, v: [N, H, D]."""
        flat = self._slots_view[layer]  # [2, total_slots, H, D]
        flat[0].index_copy_(0, slots, k)
        flat[1].index_copy_(0, slots, v)

    def _slots(self, table: list[int], num_tokens: int) -> torch.Tensor:
        """Slot index of positions 0..num_tokens-1 of a sequence: [num_tokens]."""
        nb = blocks_needed(num_tokens, self.block_size)
        blocks = torch.tensor(table[:nb], dtype=torch.long)
        offsets = torch.arange(self.block_size, dtype=torch.long)
        return (blocks[:, None] * self.block_size + offsets).flatten()[:num_tokens]

    def fork_table(self, parent_table: list[int], num_tokens: int, own_blocks: list[int]) -> list[int]:
        """A block table for a sequence that continues from the parent's first num_tokens tokens of KV.

        The parent's full blocks are shared (reference-counted: each table frees them once). The partly
        filled last block is copied into own_blocks[0]: copy-on-write, done at the fork because the
        child writes its next token there. own_blocks must cover the child's tokens past the full blocks.
        """
        num_full = num_tokens // self.block_size
        self.allocator.share(parent_table[:num_full])
        if num_tokens % self.block_size:
            self.storage[:, :, own_blocks[0]] = self.storage[:, :, parent_table[num_full]]
        return parent_table[:num_full] + own_blocks

    def write_prompt(self, table: list[int], kv: torch.Tensor, start: int = 0) -> None:
        """Copies a contiguous prompt KV into the sequence's blocks, from token `start` on (the ones before
        are in the table's blocks already).

        kv: [L, 2, T, H, D] (token-major, as prefill produces and sends it); table must hold at
        least ceil(T / block_size) blocks.
        """
        self.write_tokens(table, kv[:, :, start:], first=start)

    def write_tokens(self, table: list[int], kv: torch.Tensor, first: int) -> None:
        """Copies kv [L, 2, T, H, D], the KV of the sequence's tokens [first, first + T), into its blocks."""
        slots = self._slots(table, first + kv.shape[2])[first:].to(self.device)
        self._slots_view[:, :, slots] = kv.to(self.device)

    def gather(self, tables: list[list[int]], lengths: list[int]) -> torch.Tensor:
        """The sequences' KV right-padded with zeros to the longest: [L, 2, B, max_len, H, D].

        A copy for inspection and tests; attention reads the blocks directly.
        """
        max_len = max(lengths)
        index = torch.full((len(tables), max_len), self.pad_block * self.block_size, dtype=torch.long)
        for b, (table, length) in enumerate(zip(tables, lengths)):
            index[b, :length] = self._slots(table, length)
        slots = self._slots_view
        picked = slots.index_select(2, index.flatten().to(self.device))  # [L, 2, B * max_len, H, D]
        num_layers, _, _, heads, head_dim = slots.shape
        return picked.view(num_layers, 2, len(tables), max_len, heads, head_dim)
