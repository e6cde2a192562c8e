"""Paged KV cache: fixed-size blocks in one preallocated tensor, a block table per sequence.

Storage layout (one tensor for the whole worker):
    storage: [num_layers, 2 (key, value), num_blocks + 1, block_size, num_kv_heads, head_dim]
(token-major inside a block, so a sequence's slots gather with one index_select).

A sequence's token at position p lives in block `table[p // block_size]`, slot
`p % block_size`. The allocator hands out block ids; capacity checks are
`can_allocate()` / `allocate()` pairs, never exceptions on the hot path.
"""

from __future__ import annotations

import torch


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockAllocator:
    """Free list of block ids. Not thread-safe: the owning event loop serialises calls."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self.on_free = lambda: None  # called after every free(), e.g. to wake requests waiting for blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """Returns n block ids, or None when fewer than n are free."""
        if not self.can_allocate(n):
            return None
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))
        if blocks:
            self.on_free()


class PagedKvCache:
    """The block storage plus the gather/scatter between it and contiguous KV.

    Token slots are numbered block * block_size + offset; one extra block past the
    allocator's range stays zero and serves as padding.
    """

    def __init__(self, num_layers, num_kv_heads, head_dim, num_blocks, block_size, dtype, device):
        self.block_size = block_size
        # storage: [L, 2, num_blocks + 1, block_size, H, D]; the last block is the zero pad block
        self.storage = torch.zeros(
            (num_layers, 2, num_blocks + 1, block_size, num_kv_heads, head_dim), dtype=dtype, device=device
        )
        self.allocator = BlockAllocator(num_blocks)
        self._pad_slot = num_blocks * block_size

    @property
    def _slots_view(self) -> torch.Tensor:
        """storage as [L, 2, total_slots, H, D]."""
        num_layers, _, num_blocks, bs, heads, head_dim = self.storage.shape
        return self.storage.view(num_layers, 2, num_blocks * bs, heads, head_dim)

    def _slots(self, table: list[int], num_tokens: int) -> torch.Tensor:
        """Slot index of positions 0..num_tokens-1 of a sequence: [num_tokens]."""
        nb = blocks_needed(num_tokens, self.block_size)
        blocks = torch.tensor(table[:nb], dtype=torch.long)
        offsets = torch.arange(self.block_size, dtype=torch.long)
        return (blocks[:, None] * self.block_size + offsets).flatten()[:num_tokens]

    def write_prompt(self, table: list[int], kv: torch.Tensor) -> None:
        """Copies a contiguous prompt KV into the sequence's blocks.

        kv: [L, 2, H, T, D]; table must hold at least ceil(T / block_size) blocks.
        """
        slots = self._slots(table, kv.shape[3]).to(self.storage.device)
        self._slots_view[:, :, slots] = kv.transpose(2, 3)  # [L, 2, T, H, D]

    def write_tokens(self, tables: list[list[int]], positions: list[int], kv: torch.Tensor) -> None:
        """Writes one new token per sequence. kv: [L, 2, B, H, D]; positions[b] is its index."""
        bs = self.block_size
        slots = torch.tensor([t[p // bs] * bs + p % bs for t, p in zip(tables, positions)], device=kv.device)
        self._slots_view[:, :, slots] = kv

    def gather(self, tables: list[list[int]], lengths: list[int]) -> torch.Tensor:
        """Returns the sequences' KV left-padded to the longest: [L, 2, B, H, max_len, D].

        Padding positions hold zeros; callers mask them out of attention. One index_select
        over all sequences (the result is a transposed view, not contiguous).
        """
        max_len = max(lengths)
        index = torch.full((len(tables), max_len), self._pad_slot, dtype=torch.long)
        for b, (table, length) in enumerate(zip(tables, lengths)):
            index[b, max_len - length:] = self._slots(table, length)
        slots = self._slots_view
        picked = slots.index_select(2, index.flatten().to(slots.device))  # [L, 2, B * max_len, H, D]
        num_layers, _, _, heads, head_dim = slots.shape
        return picked.view(num_layers, 2, len(tables), max_len, heads, head_dim).transpose(3, 4)
