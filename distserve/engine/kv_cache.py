"""Paged KV cache: fixed-size blocks in one preallocated tensor, a block table per sequence.

Storage layout (one tensor for the whole worker):
    storage: [num_layers, 2 (key, value), num_blocks, num_kv_heads, block_size, head_dim]

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
    """The block storage plus the gather/scatter between it and contiguous KV."""

    def __init__(self, num_layers, num_kv_heads, head_dim, num_blocks, block_size, dtype, device):
        self.block_size = block_size
        self.storage = torch.zeros(
            (num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim), dtype=dtype, device=device
        )
        self.allocator = BlockAllocator(num_blocks)

    def write_prompt(self, table: list[int], kv: torch.Tensor) -> None:
        """Copies a contiguous prompt KV into the sequence's blocks.

        kv: [L, 2, H, T, D]; table must hold at least ceil(T / block_size) blocks.
        """
        num_tokens = kv.shape[3]
        for i in range(blocks_needed(num_tokens, self.block_size)):
            start = i * self.block_size
            end = min(start + self.block_size, num_tokens)
            self.storage[:, :, table[i], :, : end - start] = kv[:, :, :, start:end]

    def write_tokens(self, tables: list[list[int]], positions: list[int], kv: torch.Tensor) -> None:
        """Writes one new token per sequence. kv: [L, 2, B, H, D]; positions[b] is its index."""
        bs = self.block_size
        blocks = torch.tensor([t[p // bs] for t, p in zip(tables, positions)], device=kv.device)
        slots = torch.tensor([p % bs for p in positions], device=kv.device)
        # storage[:, :, blocks[b], :, slots[b]] = kv[:, :, b]; advanced indices go first: [B, L, 2, H, D]
        self.storage[:, :, blocks, :, slots] = kv.permute(2, 0, 1, 3, 4)

    def gather(self, tables: list[list[int]], lengths: list[int]) -> torch.Tensor:
        """Returns the sequences' KV left-padded to the longest: [L, 2, B, H, max_len, D].

        Padding positions hold zeros; callers mask them out of attention.
        """
        num_layers, _, _, num_heads, bs, head_dim = self.storage.shape
        max_len = max(lengths)
        out = self.storage.new_zeros((num_layers, 2, len(tables), num_heads, max_len, head_dim))
        for b, (table, length) in enumerate(zip(tables, lengths)):
            nb = blocks_needed(length, bs)
            seq = self.storage[:, :, table[:nb]]  # [L, 2, nb, H, bs, D]
            seq = seq.permute(0, 1, 3, 2, 4, 5).reshape(num_layers, 2, num_heads, nb * bs, head_dim)
            out[:, :, b, :, max_len - length :] = seq[:, :, :, :length]
        return out
