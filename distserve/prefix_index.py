"""A router's estimate of which prompt prefixes each worker holds in its prefix cache (torch-free).

The router cannot see a worker's cache, so it remembers what it sent: after routing a prompt to a
worker it records the prompt's full-block keys under that worker, as the worker will store them once
it has prefilled them. A later prompt's expected hit on a worker is the longest run of its keys from
the first that the worker's record holds, as the worker's own lookup is.

It is an estimate, and errs both ways: the worker may have evicted blocks (a record holds at most the
worker's published capacity, dropped least recently used first, as the worker's pool is), and other
routers' prompts are not seen. Routing uses it only to compare workers' costs; the worker's own
cache decides what is reused, and the response reports what was.

Keys are this router's own: the chain of distserve.prefix_hash seeded with the model and the
request's cache_salt, so prompts under different salts never look alike.
"""

from __future__ import annotations

import collections

from distserve.prefix_hash import PrefixNamespace, block_keys


class PromptBlocks:
    """One prompt's block keys, computed once per block size on first use."""

    def __init__(self, model: str, token_ids: list[int], cache_salt: str = ""):
        self.model, self.token_ids, self.cache_salt = model, token_ids, cache_salt
        self._keys: dict[int, list[bytes]] = {}

    def keys(self, block_size: int) -> list[bytes]:
        if block_size not in self._keys:
            seed = PrefixNamespace(self.model, "router", block_size).seed(self.cache_salt)
            self._keys[block_size] = block_keys(self.token_ids, block_size, seed)
        return self._keys[block_size]


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

    def retain(self, worker_ids: set[str]) -> None:
        """Forgets every worker not in worker_ids (gone from the registry: a restarted one starts empty)."""
        for worker_id in list(self._held):
            if worker_id not in worker_ids:
                del self._held[worker_id]

    def num_blocks(self, worker_id: str) -> int:
        return len(self._held.get(worker_id, ()))
