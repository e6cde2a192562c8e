"""Prefix cache: the KV of prompts' full blocks, kept after their prefill so later prompts that start
with the same tokens compute only the rest.

Blocks live in one preallocated pool:
    storage: [num_layers, 2 (key, value), num_blocks, block_size, num_kv_heads, head_dim]
keyed by the hash chain of distserve.prefix_hash (equal keys: equal tokens at equal positions under
the same model, dtype and salt). Each block is in one of three states:
  - free: never used, or evicted;
  - cached: keyed, holding KV, reference count 0, in the LRU order (evictable);
  - pinned: keyed, reference count > 0 (a waiting prompt will copy it); never evicted.
Unreferenced blocks are evicted least recently used first, and only when a store needs a block. A
chain's blocks enter the LRU order tail first, so the tail of a prefix, the part least likely to be
shared, is evicted before its head.

Threads: lookups and releases come from the event loop, stores and copies from the forward thread.
One lock guards the bookkeeping; a block's data is written only while no key points at it, and read
only while pinned, so copies run outside the lock.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Any

import torch

from distserve.prefix_events import PREFILL_CACHE, PrefixEventLog
from distserve.prefix_hash import PrefixNamespace, block_keys, longest_run, reusable_keys


@dataclasses.dataclass
class CachedPrefix:
    """Pinned blocks holding the KV of a prompt's first num_tokens tokens, in order, in `source` (the
    PrefixCache or distserve.engine.paged_prefix.PagedPrefix that loads and releases them)."""

    blocks: list[int]
    block_size: int
    source: Any = None

    @property
    def num_tokens(self) -> int:
        return len(self.blocks) * self.block_size


@dataclasses.dataclass
class PrefixCacheStats:
    """Counters since start, in tokens (as vLLM's prefix_cache_queries / _hits) and blocks."""

    queried_tokens: int = 0  # prompt tokens looked up
    hit_tokens: int = 0  # of those, found cached
    stored_blocks: int = 0
    evicted_blocks: int = 0


class PrefixCache:
    def __init__(self, namespace: PrefixNamespace, num_blocks: int, num_layers: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: str | torch.device = "cpu"):
        self.namespace = namespace
        self.block_size = namespace.block_size
        self.num_blocks = num_blocks
        # Uninitialised: pages are touched only as blocks are stored, so an idle cache costs no memory.
        self.storage = torch.empty((num_layers, 2, num_blocks, self.block_size, num_kv_heads, head_dim),
                                   dtype=dtype, device=device)
        self.stats = PrefixCacheStats()
        self._lock = threading.Lock()
        self._free = list(range(num_blocks - 1, -1, -1))
        self._block_of: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self._refs: dict[int, int] = {}  # pinned blocks only
        self._lru: collections.OrderedDict[int, None] = collections.OrderedDict()  # cached, unpinned; oldest first
        self.events: PrefixEventLog | None = None  # told what is stored and evicted (the routers' index)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._block_of)

    @property
    def version(self) -> int:
        """Grows whenever blocks are stored: a look-up that found nothing may find more after it does."""
        return self.stats.stored_blocks

    def keys(self, prompt: list[int], cache_salt: str = "") -> list[bytes]:
        """The keys of the prompt's full blocks."""
        return block_keys(prompt, self.block_size, self.namespace.seed(cache_salt))

    def lookup(self, keys: list[bytes], num_prompt_tokens: int) -> CachedPrefix:
        """Pins the longest cached run of `keys` from the first, leaving at least the prompt's last token
        to compute (its logits give the first token). Release the result (`release`) once copied or dropped.
        Counts nothing: `count_query` records the look-up whose result a prompt used."""
        usable = reusable_keys(keys, num_prompt_tokens, self.block_size)
        with self._lock:
            blocks = longest_run(usable, self._block_of)
            for block in blocks:
                self._lru.pop(block, None)
                self._refs[block] = self._refs.get(block, 0) + 1
        return CachedPrefix(blocks, self.block_size, source=self)

    def count_query(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        """Counts one prompt's look-up: its tokens, and those it found cached."""
        with self._lock:
            self.stats.queried_tokens += num_prompt_tokens
            self.stats.hit_tokens += num_hit_tokens

    def load(self, prefix: CachedPrefix, kv: torch.Tensor) -> None:
        """Copies the pinned prefix's KV into a prompt's buffer kv [L, 2, T, Hkv, D] (T >= prefix tokens)."""
        if not prefix.blocks:
            return
        num_layers, _, _, heads, head_dim = kv.shape
        picked = self.storage[:, :, prefix.blocks]  # [L, 2, n, block_size, Hkv, D]
        kv[:, :, :prefix.num_tokens] = picked.view(num_layers, 2, prefix.num_tokens, heads, head_dim)

    def release(self, prefix: CachedPrefix) -> None:
        """Unpins the prefix's blocks (once per lookup); the last holder makes a block evictable again."""
        with self._lock:
            for block in reversed(prefix.blocks):  # the chain's tail becomes the older entry
                left = self._refs[block] - 1
                if left:
                    self._refs[block] = left
                else:
                    del self._refs[block]
                    self._lru[block] = None
        prefix.blocks = []

    def store(self, keys: list[bytes], kv: torch.Tensor) -> int:
        """Caches the full blocks of a computed prompt, kv [L, 2, T, Hkv, D] whose full blocks `keys`
        name, that are not cached yet; evicts unpinned blocks as needed. Returns how many it stored."""
        evicted: list[bytes] = []
        with self._lock:
            self._touch_chain(keys)  # the chain's cached blocks are not what this store evicts
            todo = [(i, key) for i, key in enumerate(keys) if key not in self._block_of]
            taken = []
            for _ in todo:
                block = self._take_block(evicted)
                if block is None:
                    break
                taken.append(block)
        todo = todo[:len(taken)]
        if self.events is not None:
            self.events.evicted(PREFILL_CACHE, evicted)
        bs = self.block_size
        for (i, _), block in zip(todo, taken):
            self.storage[:, :, block] = kv[:, :, i * bs:(i + 1) * bs]
        with self._lock:
            for (_, key), block in zip(todo, taken):
                self._block_of[key], self._key_of[block] = block, key
                self._lru[block] = None
            self._touch_chain(keys)
            self.stats.stored_blocks += len(taken)
        if self.events is not None:
            self.events.stored(PREFILL_CACHE, [key for _, key in todo])
        return len(taken)

    def _touch_chain(self, keys: list[bytes]) -> None:
        """Makes the chain's unpinned cached blocks the most recently used, its tail the oldest of them
        (evicted first). Under the lock."""
        for key in reversed(keys):
            block = self._block_of.get(key)
            if block is not None and block in self._lru:
                self._lru.move_to_end(block)

    def _take_block(self, evicted: list[bytes]) -> int | None:
        """A block to write: a free one, else the least recently used unpinned one (evicted: its key is
        appended to `evicted`). Under the lock."""
        if self._free:
            return self._free.pop()
        if not self._lru:
            return None
        block, _ = self._lru.popitem(last=False)
        key = self._key_of.pop(block)
        del self._block_of[key]
        evicted.append(key)
        self.stats.evicted_blocks += 1
        return block


def prefix_cache_blocks(budget_mb: int, kv_bytes_per_token: int, block_size: int) -> int:
    """Blocks a prefix cache of `budget_mb` MiB holds (0 when the budget holds none)."""
    return budget_mb * 1024 * 1024 // (kv_bytes_per_token * block_size)


def build_prefix_cache(config, model: str, spec, dtype: str, device: str) -> PrefixCache | None:
    """The prefix cache a worker's prefill side uses, from its PrefixCacheConfig (None when off or empty).
    `model` names the model as the deployment does; `spec` is its ModelSpec; `dtype` the KV dtype name."""
    from distserve.engine.dtype import torch_dtype
    torch_dtype = torch_dtype(dtype)
    num_blocks = prefix_cache_blocks(config.prefix_cache_mb, spec.kv_bytes_per_token(torch_dtype),
                                     config.prefix_block_size)
    if not config.prefix_caching or not num_blocks:
        return None
    namespace = PrefixNamespace(model, dtype, config.prefix_block_size, config.prefix_seed)
    return PrefixCache(namespace, num_blocks, spec.num_layers, spec.num_kv_heads, spec.head_dim, torch_dtype, device)
