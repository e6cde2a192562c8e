"""A segmented LRU cache: entries seen once cannot flush the ones in repeated use.

A plain LRU of compiled grammars is flushed by anyone who sends many distinct specs: each new one evicts
the oldest, and every tenant's hot specs compile again. Here a new key enters a small probation segment;
only a second hit promotes it to the protected segment. A flood of one-off keys churns probation alone,
and a protected entry leaves only when other entries are promoted past it (it is then demoted to
probation, where one more hit saves it).
"""

from __future__ import annotations

import collections
import threading
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class SegmentedLru(Generic[K, V]):
    """Thread-safe. capacity entries in all, probation_capacity of them for keys seen once."""

    def __init__(self, capacity: int, probation_capacity: int):
        if not 0 < probation_capacity < capacity:
            raise ValueError(f"need 0 < probation_capacity ({probation_capacity}) < capacity ({capacity})")
        self._probation: collections.OrderedDict[K, V] = collections.OrderedDict()
        self._protected: collections.OrderedDict[K, V] = collections.OrderedDict()
        self._probation_capacity = probation_capacity
        self._protected_capacity = capacity - probation_capacity
        self._lock = threading.Lock()

    def get(self, key: K) -> V | None:
        """The value, or None; a hit in probation promotes the key to protected."""
        with self._lock:
            if key in self._protected:
                self._protected.move_to_end(key)
                return self._protected[key]
            if key not in self._probation:
                return None
            value = self._probation.pop(key)
            self._protected[key] = value
            if len(self._protected) > self._protected_capacity:
                demoted, demoted_value = self._protected.popitem(last=False)
                self._add_to_probation(demoted, demoted_value)
            return value

    def put(self, key: K, value: V) -> None:
        """Stores a key not seen before in probation (a known key keeps its segment, with the new value)."""
        with self._lock:
            if key in self._protected:
                self._protected[key] = value
                self._protected.move_to_end(key)
            else:
                self._probation.pop(key, None)
                self._add_to_probation(key, value)

    def keys(self) -> tuple[K, ...]:
        """Probation's keys, then protected's, each least recently used first."""
        with self._lock:
            return (*self._probation, *self._protected)

    def protected_keys(self) -> tuple[K, ...]:
        with self._lock:
            return tuple(self._protected)

    def __len__(self) -> int:
        with self._lock:
            return len(self._probation) + len(self._protected)

    def _add_to_probation(self, key: K, value: V) -> None:
        self._probation[key] = value
        while len(self._probation) > self._probation_capacity:
            self._probation.popitem(last=False)
