"""A router's estimate of which prompt prefixes each worker holds in its caches (torch-free).

The router cannot see a worker's cache, so it learns it two ways:
  - from what it sends: after routing a prompt to a worker it records the prompt's full-block keys
    under that worker, as the worker will store them once it has prefilled them;
  - from the workers themselves: they publish the blocks they store and evict
    (distserve.prefix_events), which every router folds in, so one router also sees what other routers
    sent, and what a worker evicted.
A later prompt's expected hit on a worker is the longest run of its keys from the first that the
worker's record holds, as the worker's own lookup is.

It is an estimate, and may be stale (events arrive within a tenth of a second; a record holds at most
the worker's published capacity, dropped least recently used first, as the worker's pool is). Routing
uses it only to compare workers' costs; the worker's own cache decides what is reused, and the response
reports what was.

Keys are the workers' own (distserve.prefix_hash): the chain seeded with the model, the worker's KV
dtype (the suffix of its record's kv_format), the block size, the deployment's seed and the request's
cache_salt, so prompts under different salts never look alike.
"""

from __future__ import annotations

import collections

from distserve.prefix_hash import PrefixNamespace, block_keys


class PromptBlocks:
    """One prompt's block keys, computed once per (block size, dtype) on first use; `model` and
    `deployment_seed` as the workers' (their model setting and DISTSERVE_PREFIX_SEED)."""

    def __init__(self, model: str, token_ids: list[int], cache_salt: str = "", deployment_seed: str = ""):
        self.model, self.token_ids, self.cache_salt = model, token_ids, cache_salt
        self.deployment_seed = deployment_seed
        self._keys: dict[tuple[int, str], list[bytes]] = {}

    def keys(self, block_size: int, dtype: str = "") -> list[bytes]:
        """The keys a worker whose cache has `block_size` blocks of `dtype` KV gives the prompt's full blocks."""
        if (block_size, dtype) not in self._keys:
            seed = PrefixNamespace(self.model, dtype, block_size, self.deployment_seed).seed(self.cache_salt)
            self._keys[block_size, dtype] = block_keys(self.token_ids, block_size, seed)
        return self._keys[block_size, dtype]


class PrefixIndex:
    """Per worker id, the block keys routed there, least recently used first."""

    def __init__(self, default_capacity: int = 1 << 16):
        self.default_capacity = default_capacity  # blocks kept for a worker that publishes no capacity
        self._held: dict[str, collections.OrderedDict[bytes, None]] = {}

    def cached_blocks(self, worker_id: str, keys: list[bytes]) -> int:
        """How many of `keys`, from the first, the worker is expected to hold."""
        held = self._held.get(worker_id)
        if not held:
            return 0
        count = 0
        for key in keys:
            if key not in held:
                break
            count += 1
        return count

    def record(self, worker_id: str, keys: list[bytes], capacity: int = 0) -> None:
        """The worker is about to hold `keys` (capacity: its cache's blocks, 0 for unknown); the chain is
        touched tail first, so that its head is the most recently used, as the worker's pool does."""
        held = self._held.setdefault(worker_id, collections.OrderedDict())
        for key in reversed(keys):
            held[key] = None
            held.move_to_end(key)
        limit = capacity or self.default_capacity
        while len(held) > limit:
            held.popitem(last=False)

    def forget(self, worker_id: str, keys: tuple[bytes, ...] | list[bytes]) -> None:
        """The worker no longer holds `keys` (it evicted them)."""
        held = self._held.get(worker_id)
        if held:
            for key in keys:
                held.pop(key, None)

    def forget_worker(self, worker_id: str) -> None:
        """The worker holds nothing (it started afresh)."""
        self._held.pop(worker_id, None)

    def retain(self, worker_ids: set[str]) -> None:
        """Forgets every worker not in worker_ids (gone from the registry: a restarted one starts empty)."""
        for worker_id in list(self._held):
            if worker_id not in worker_ids:
                del self._held[worker_id]

    def num_blocks(self, worker_id: str) -> int:
        return len(self._held.get(worker_id, ()))
