"""Choosing workers: least-loaded from the live registry, corrected by this router's own in-flight work.

Registry load figures are up to one heartbeat old, so the router adds what it
has sent since: outstanding prompt tokens for prefill, open streams for decode.
A worker whose call failed to connect is skipped for `suspect_s` seconds (its
registry entry may outlive it by up to one lease).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time

import redis.asyncio as aioredis

from distserve.registry import WorkerRecord, WorkerRegistry

log = logging.getLogger(__name__)


class WorkerPicker:
    def __init__(self, registry: WorkerRegistry, suspect_s: float):
        self._registry = registry
        self._suspect_s = suspect_s
        self._workers: dict[str, list[WorkerRecord]] = {"prefill": [], "decode": [], "colocated": []}
        self._inflight: collections.Counter[str] = collections.Counter()
        self._suspect_until: dict[str, float] = {}

    async def refresh(self) -> None:
        for role in self._workers:
            self._workers[role] = await self._registry.list(role)

    async def run_refresh(self, interval_s: float) -> None:
        while True:
            try:
                await self.refresh()
            except (aioredis.RedisError, OSError) as exc:
                log.warning("registry refresh failed: %s", exc)
            except Exception:  # this loop must outlive any one bad refresh, or routing freezes
                log.exception("registry refresh failed")
            await asyncio.sleep(interval_s)

    def workers(self, role: str) -> list[WorkerRecord]:
        """The registered `role` workers, less those that failed within suspect_s; all of them when
        every one did (a suspect may be back already, e.g. restarted: trying beats refusing)."""
        now = time.monotonic()
        healthy = [w for w in self._workers[role] if self._suspect_until.get(w.worker_id, 0) <= now]
        return healthy or list(self._workers[role])

    def pick_prefill(self, num_tokens: int = 0) -> WorkerRecord | None:
        """The prefill worker with the fewest outstanding prompt tokens among those with room for
        num_tokens more; None when none has (see `prefill_has_room`)."""
        roomy = [w for w in self.workers("prefill") if self.prefill_has_room(w, num_tokens)]
        return min(roomy, default=None, key=lambda w: w.load.get("outstanding_tokens", 0) + self._inflight[w.worker_id])

    def prefill_has_room(self, worker: WorkerRecord, num_tokens: int) -> bool:
        """Whether the worker's published caps admit num_tokens more prompt tokens: its queue (an
        idle one takes any prompt) and its held KV. The worker enforces both; checking here turns
        excess load away without a call."""
        load = worker.load
        queued = load.get("outstanding_tokens", 0) + self._inflight[worker.worker_id]
        queue_cap = load.get("max_queued_tokens", 0)
        held_cap = load.get("max_held_bytes", 0)
        return not ((queue_cap and queued and queued + num_tokens > queue_cap)
                    or (held_cap and load.get("held_bytes", 0) >= held_cap))

    def pick_colocated(self, num_tokens: int = 0) -> WorkerRecord | None:
        """The colocated worker with the fewest outstanding prompt tokens (then fewest decoding) whose
        KV cache can hold num_tokens at all."""
        def score(w: WorkerRecord):
            return (w.load.get("outstanding_tokens", 0) + self._inflight[w.worker_id], w.load.get("num_running", 0))

        fits = [w for w in self.workers("colocated")
                if w.load.get("total_blocks", float("inf")) * w.load.get("block_size", 1) >= num_tokens]
        return min(fits, default=None, key=score)

    def prefers_colocated(self, colocated: WorkerRecord | None, prefill: WorkerRecord | None) -> bool:
        """In a mixed fleet, whether a request goes to `colocated` rather than the prefill/decode pair:
        the one with fewer outstanding prompt tokens (what delays the first token); ties go to the
        pair, whose decode steps no prompt lengthens."""
        if colocated is None or prefill is None:
            return colocated is not None

        def outstanding(w: WorkerRecord) -> float:
            return w.load.get("outstanding_tokens", 0) + self._inflight[w.worker_id]

        return outstanding(colocated) < outstanding(prefill)

    def pick_decode(self, num_tokens: int = 0, kv_format: str = "") -> WorkerRecord | None:
        """The least-loaded decode worker whose KV cache can hold num_tokens at all, and takes KV of
        `kv_format` (the prefill worker's layout and dtype) when given.

        Workers with enough free blocks right now come first; one without still qualifies (the
        request waits there for blocks) unless as many requests wait there as it allows; one too
        small for the request never does.
        """
        def blocks(w: WorkerRecord) -> int:
            size = int(w.load.get("block_size", 1)) or 1
            return -(-num_tokens // size)

        def score(w: WorkerRecord):
            running = w.load.get("num_running", 0) + w.load.get("num_waiting", 0) + self._inflight[w.worker_id]
            free = w.load.get("free_blocks", 0)
            return (free < blocks(w), running, -free)

        def full(w: WorkerRecord) -> bool:  # no free blocks now, and as many requests wait as it allows
            waiting_cap = w.load.get("max_reserving", 0)
            return (w.load.get("free_blocks", 0) < blocks(w) and waiting_cap
                    and w.load.get("num_reserving", 0) >= waiting_cap)

        fits = [w for w in self.workers("decode") if w.load.get("total_blocks", float("inf")) >= blocks(w)
                and (not kv_format or w.kv_format == kv_format) and not full(w)]
        return min(fits, default=None, key=score)

    @contextlib.contextmanager
    def track(self, worker: WorkerRecord, amount: int):
        """Counts `amount` of work as in flight on worker for the duration of the block."""
        self._inflight[worker.worker_id] += amount
        try:
            yield
        finally:
            self._inflight[worker.worker_id] -= amount

    def mark_suspect(self, worker: WorkerRecord) -> None:
        log.warning("worker %s unreachable; skipping it for %.1fs", worker.worker_id, self._suspect_s)
        self._suspect_until[worker.worker_id] = time.monotonic() + self._suspect_s
