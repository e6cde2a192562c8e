"""The cluster-wide prefix index's feed: workers publish which prefix blocks they store and evict, and
every router folds the events into its estimate of each worker's caches (torch-free).

Workers append events to one Redis stream, STREAM_KEY, trimmed to about MAX_ENTRIES. An entry is

    w: the worker id    c: the cache (PREFILL_CACHE or PAGED_CACHE)    op: STORED, EVICTED or RESET
    k: the blocks' keys (distserve.prefix_hash), KEY_BYTES each, concatenated, in chain order

PREFILL_CACHE is a prefill side's prefix cache (distserve.engine.prefix_cache), PAGED_CACHE a decode
side's paged cache (distserve.engine.shared_blocks: prompts, and finished answers). A worker starts its
feed with RESET, so a router forgets what an earlier process under the same id held.

Engines record events from any thread into a PrefixEventLog; a worker's `publish_prefix_events` loop
moves them to the stream every PUBLISH_INTERVAL_S, in one pipelined round trip. A router's
`follow_prefix_events` replays the retained stream, then blocks on it for new entries: no request waits
on Redis for this. Lost events (Redis restarted, or a router that fell behind the trim) only make the
estimate stale; the worker's own cache decides what is reused. Nothing here is trusted for correctness,
so entries carry no MAC: a forged one can skew routing, never what a request computes or reads.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import threading
from typing import Awaitable, Callable

import redis.asyncio as aioredis

from distserve import redis_client

log = logging.getLogger(__name__)

STREAM_KEY = "distserve:prefix-events"
MAX_ENTRIES = 20_000  # about: XADD trims approximately, in whole macro-nodes
KEY_BYTES = 32  # a SHA-256 chain key
MAX_KEYS_PER_ENTRY = 64  # a longer run is split, so one entry stays small (2 KiB of keys)
PUBLISH_INTERVAL_S = 0.1
READ_BLOCK_MS = 1000  # under redis_client.SOCKET_TIMEOUT_S: a blocked read is no stalled socket
READ_COUNT = 500

PREFILL_CACHE, PAGED_CACHE = "prefill", "paged"
STORED, EVICTED, RESET = "+", "-", "0"


@dataclasses.dataclass(frozen=True)
class PrefixEvent:
    worker_id: str
    cache: str  # PREFILL_CACHE or PAGED_CACHE
    op: str  # STORED, EVICTED or RESET
    keys: tuple[bytes, ...] = ()


class PrefixEventLog:
    """A worker's events not yet published; engines call stored/evicted from any thread."""

    def __init__(self, max_pending: int = 100_000):
        self._lock = threading.Lock()
        self._pending: collections.deque[tuple[str, str, tuple[bytes, ...]]] = collections.deque()
        self._max_pending = max_pending  # while Redis is away: the oldest are dropped (the estimate is stale anyway)
        self.num_dropped = 0

    def stored(self, cache: str, keys: list[bytes]) -> None:
        self._add(cache, STORED, keys)

    def evicted(self, cache: str, keys: list[bytes]) -> None:
        self._add(cache, EVICTED, keys)

    def _add(self, cache: str, op: str, keys: list[bytes]) -> None:
        if not keys:
            return
        with self._lock:
            for start in range(0, len(keys), MAX_KEYS_PER_ENTRY):
                self._pending.append((cache, op, tuple(keys[start:start + MAX_KEYS_PER_ENTRY])))
            while len(self._pending) > self._max_pending:
                self._pending.popleft()
                self.num_dropped += 1

    def drain(self) -> list[tuple[str, str, tuple[bytes, ...]]]:
        with self._lock:
            pending, self._pending = list(self._pending), collections.deque()
        return pending


async def publish_prefix_events(redis: aioredis.Redis, worker_id: str, events: PrefixEventLog,
                                caches: tuple[str, ...], interval_s: float = PUBLISH_INTERVAL_S) -> None:
    """Publishes `events` until cancelled, after a RESET of each of `caches`; survives Redis blips: the
    events of a failed round are lost, so the next round starts with a RESET again (routers forget what
    they knew of this worker rather than keep keys it may have evicted meanwhile)."""
    resets = [(cache, RESET, ()) for cache in caches]
    batch = list(resets)
    while True:
        batch += events.drain()
        if batch:
            try:
                async with redis.pipeline(transaction=False) as pipe:
                    for cache, op, keys in batch:
                        pipe.xadd(STREAM_KEY, {"w": worker_id, "c": cache, "op": op, "k": b"".join(keys)},
                                  maxlen=MAX_ENTRIES, approximate=True)
                    await pipe.execute()
                redis_client.raise_if_cancelled()
                batch = []
            except (aioredis.RedisError, OSError) as exc:
                log.warning("publishing %d prefix events failed: %s", len(batch), exc)
                redis_client.raise_if_cancelled()
                batch = list(resets)
        await asyncio.sleep(interval_s)


def parse_entry(fields: dict[bytes, bytes]) -> PrefixEvent | None:
    """The event an entry holds, or None for a malformed one."""
    try:
        worker_id, cache, op, packed = (fields[b"w"].decode(), fields[b"c"].decode(), fields[b"op"].decode(),
                                        fields[b"k"])
    except (KeyError, UnicodeDecodeError):
        return None
    if cache not in (PREFILL_CACHE, PAGED_CACHE) or op not in (STORED, EVICTED, RESET) or len(packed) % KEY_BYTES:
        return None
    return PrefixEvent(worker_id, cache, op, tuple(packed[i:i + KEY_BYTES] for i in range(0, len(packed), KEY_BYTES)))


async def follow_prefix_events(redis: aioredis.Redis, apply: Callable[[PrefixEvent], None],
                               block_ms: int = READ_BLOCK_MS) -> None:
    """Calls `apply` for every event in the stream, the retained ones first, then each new one as it is
    added, until cancelled; survives Redis blips (reading on from the last entry seen)."""
    last_id = "0-0"
    while True:
        try:
            replies = await redis.xread({STREAM_KEY: last_id}, count=READ_COUNT, block=block_ms)
            redis_client.raise_if_cancelled()
        except (aioredis.RedisError, OSError) as exc:
            log.warning("reading prefix events failed: %s", exc)
            redis_client.raise_if_cancelled()
            await asyncio.sleep(1.0)
            continue
        for _, entries in replies:
            for entry_id, fields in entries:
                last_id = entry_id
                event = parse_entry(fields)
                if event is None:
                    log.warning("skipping a malformed prefix event %s", entry_id)
                    continue
                try:
                    apply(event)
                except Exception:  # one bad event must not end the router's view of every later one
                    log.exception("applying prefix event %s failed", entry_id)


def attach_prefix_events(redis: aioredis.Redis, worker_id: str, prefill_cache=None,
                         paged_cache=None) -> list[Callable[[], Awaitable[None]]]:
    """Points a worker's caches at one PrefixEventLog: its prefill side's prefix cache (a
    distserve.engine.prefix_cache.PrefixCache) and its paged cache's listed blocks (a
    distserve.engine.shared_blocks.SharedBlocks), either None where it has none. Returns the worker's
    loops that publish their events: one, or none when it caches nothing."""
    caches = {PREFILL_CACHE: prefill_cache, PAGED_CACHE: paged_cache}
    caches = {name: cache for name, cache in caches.items() if cache is not None}
    if not caches:
        return []
    events = PrefixEventLog()
    for cache in caches.values():
        cache.events = events
    return [lambda: publish_prefix_events(redis, worker_id, events, tuple(caches))]
