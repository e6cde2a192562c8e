"""A worker's paged KV cache as a prefix source for its own prefill side (colocated engines).

A worker that prefills and decodes in one process keeps the KV of what it decoded in its paged cache:
prompts, and the answers of finished sequences (distserve.engine.shared_blocks lists their full blocks,
and the allocator keeps them cached after their last holder frees them). A chat's next turn starts
with the last turn's prompt and answer, so its prefill can copy all of that from the paged cache and
compute only the new message; the prefill side's own prefix cache holds prompts, never answers.

Same contract as PrefixCache (lookup pins, load copies, release unpins), over the decode engine's
SharedBlocks: a pinned block is one more holder in the allocator, so it is neither evicted nor written
while the prompt waits. Lookups run on the event loop, as the allocator requires; a release from the
forward thread (PrefillBatcher.works unpins right after the copy) is handed to the loop.
"""

from __future__ import annotations

import asyncio
import threading

import torch

from distserve.engine.prefix_cache import CachedPrefix
from distserve.engine.shared_blocks import SharedBlocks
from distserve.prefix_hash import PrefixNamespace, block_keys, reusable_keys


class PagedPrefix:
    def __init__(self, shared: SharedBlocks, storage: torch.Tensor, namespace: PrefixNamespace):
        """storage: the paged cache's [L, 2, num_blocks + 1, block_size, Hkv, D]; namespace: the one its
        blocks are keyed in (its block size is the cache's)."""
        self._shared = shared
        self._storage = storage
        self.namespace = namespace
        self.block_size = namespace.block_size
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None

    @property
    def version(self) -> int:
        """Grows whenever blocks are listed: a look-up that found nothing may find more after it does."""
        return self._shared.num_listed

    def keys(self, prompt: list[int], cache_salt: str = "") -> list[bytes]:
        return block_keys(prompt, self.block_size, self.namespace.seed(cache_salt))

    def lookup(self, keys: list[bytes], num_prompt_tokens: int) -> CachedPrefix:
        """Pins the longest listed run of `keys`, leaving at least the prompt's last token to compute."""
        if self._loop is None:
            self._loop, self._loop_thread = asyncio.get_running_loop(), threading.get_ident()
        usable = reusable_keys(keys, num_prompt_tokens, self.block_size)
        return CachedPrefix(self._shared.take(usable), self.block_size, source=self)

    def load(self, prefix: CachedPrefix, kv: torch.Tensor) -> None:
        """Copies the pinned blocks' KV into a prompt's buffer kv [L, 2, T, Hkv, D] (T >= prefix tokens)."""
        if not prefix.blocks:
            return
        num_layers, _, _, heads, head_dim = kv.shape
        picked = self._storage[:, :, prefix.blocks]  # [L, 2, n, block_size, Hkv, D]
        kv[:, :, :prefix.num_tokens] = picked.view(num_layers, 2, prefix.num_tokens, heads, head_dim).to(kv.device)

    def release(self, prefix: CachedPrefix) -> None:
        """Unpins the blocks (once per lookup), on the event loop whatever thread calls."""
        blocks, prefix.blocks = prefix.blocks, []
        if not blocks:
            return
        if threading.get_ident() == self._loop_thread:
            self._shared.release(blocks)
        else:
            self._loop.call_soon_threadsafe(self._shared.release, blocks)
