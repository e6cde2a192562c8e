"""The simulator's parts shared by every worker: the event loop, request state, step time, the KV
block pool; and the prefill worker, mirroring the real engine's policy.

Prefill (distserve/engine/prefill_batcher.py): waiting -> chunks -> prefilled -> transfer queue -> sent.
  Idle with prompts waiting, it takes a packed batch under `max_batch_tokens`: whole prompts that fit
  (arrival order, a prompt skipped MAX_SKIPS times first), then the rest of the budget as chunks.
  A prompt's first token is out when its last chunk's step ends. KV transfers leave one at a time
  per prefill worker (one UCX endpoint per peer) and never block the prefill loop.
KV blocks (decode and colocated workers): prompt + output reserved up front, as DecodeEngine.reserve.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import math
from typing import Callable

from distserve.planner.profile import Profile, chunk_attn_pairs

# Mirrors distserve.engine.prefill_batcher.MAX_SKIPS (not imported: that module pulls in torch).
MAX_SKIPS = 4


class EventLoop:
    """A deterministic discrete-event loop: callbacks run in (time, scheduling order)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.is_stopped = False
        self._queue: list = []
        self._order = itertools.count()

    def call_at(self, when: float, fn: Callable, *args) -> None:
        heapq.heappush(self._queue, (when, next(self._order), fn, args))

    def call_later(self, delay: float, fn: Callable, *args) -> None:
        self.call_at(self.now + delay, fn, *args)

    def run(self) -> None:
        while self._queue and not self.is_stopped:
            self.now, _, fn, args = heapq.heappop(self._queue)
            fn(*args)


class SimRequest:
    """One request's progress through the simulated system (times in simulated seconds)."""

    __slots__ = ("index", "arrival_s", "input_len", "output_len", "num_computed", "num_skipped",
                 "num_generated", "num_blocks", "first_token_s", "finish_s", "decode_worker")

    def __init__(self, index: int, arrival_s: float, input_len: int, output_len: int):
        self.index, self.arrival_s = index, arrival_s
        self.input_len, self.output_len = input_len, output_len
        self.num_computed = 0  # prompt tokens prefilled
        self.num_skipped = 0  # consecutive prefill batches this prompt waited through
        self.num_generated = 0  # output tokens so far (the first comes from prefill)
        self.num_blocks = 0  # KV blocks reserved on its decode/colocated worker
        self.first_token_s: float | None = None
        self.finish_s: float | None = None
        self.decode_worker = None  # DecodeSim chosen at routing time

    @property
    def num_remaining(self) -> int:
        return self.input_len - self.num_computed

    @property
    def context_len(self) -> int:
        """Tokens whose KV is cached while it makes its next token (Sequence.context_len)."""
        return self.input_len + self.num_generated - 1


def step_seconds(profile: Profile, prompt_tokens: int, prompt_attn: int, num_decode: int,
                 decode_context: int) -> float:
    """One step's time from its totals: the profile's linear model over STEP_FEATURES, or the
    profile's own `step_time_from_totals` when it has one (roofline profiles: compute and memory
    are not additive there, and prompt attention is compute- while decode attention is memory-bound).
    Totals instead of a StepShape because decode steps run by the thousand per simulation."""
    custom = getattr(profile, "step_time_from_totals", None)
    if custom is not None:
        return custom(prompt_tokens, prompt_attn, num_decode, decode_context)
    c_step, c_token, c_prompt_attn, c_decode_context, c_decode = profile.step_coeffs
    return (c_step + c_token * (prompt_tokens + num_decode) + c_prompt_attn * prompt_attn
            + c_decode_context * decode_context + c_decode * num_decode)


def take_prefill_batch(waiting: list[SimRequest], budget: int) -> list[tuple[SimRequest, int]]:
    """PrefillBatcher._take_batch on simulated prompts: (prompt, chunk tokens) in arrival order.
    Updates skip counts and drops prompts whose last chunk is taken from `waiting`."""
    order = sorted(waiting, key=lambda r: r.num_skipped < MAX_SKIPS)  # stable: starving first
    taken: dict[int, int] = {}
    for req in order:  # whole prompts that fit; a starving one takes what it can
        if req.num_remaining <= budget or (req.num_skipped >= MAX_SKIPS and budget):
            taken[req.index] = min(req.num_remaining, budget)
            budget -= taken[req.index]
    for req in order:  # the rest of the budget as chunks
        if budget and req.index not in taken:
            taken[req.index] = min(req.num_remaining, budget)
            budget -= taken[req.index]
    batch = [(req, taken[req.index]) for req in waiting if req.index in taken]
    for req in waiting:
        req.num_skipped = 0 if req.index in taken else req.num_skipped + 1
    waiting[:] = [r for r in waiting if taken.get(r.index, -1) != r.num_remaining]
    return batch


def take_whole_prompts(waiting: list[SimRequest], budget: int, max_prompts: int) -> list[tuple[SimRequest, int]]:
    """A prefill-only step without chunking, as vLLM before chunked prefill and DistServe's own simulator
    schedule it (simdistserve/base/worker.py `_enter_prefill`): whole prompts in arrival order while they
    fit `budget`, at most `max_prompts` (the sequences that may still join), stopping at the first that
    does not fit; the first is taken whatever its length."""
    batch: list[tuple[SimRequest, int]] = []
    for req in waiting:
        if len(batch) == max_prompts or (batch and req.num_remaining > budget):
            break
        batch.append((req, req.num_remaining))
        budget -= req.num_remaining
    del waiting[:len(batch)]
    return batch


class PrefillSim:
    """A prefill worker: the batching loop plus its one-at-a-time KV send queue."""

    def __init__(self, loop: EventLoop, profile: Profile, max_batch_tokens: int, node: int,
                 on_prefilled: Callable[[SimRequest, "PrefillSim"], None]):
        self.loop, self.profile, self.node = loop, profile, node
        self.max_batch_tokens = max_batch_tokens
        self.outstanding_tokens = 0  # prompt tokens not yet prefilled: the router's load figure
        self._on_prefilled = on_prefilled
        self._waiting: list[SimRequest] = []
        self._is_busy = False
        self._sends: collections.deque = collections.deque()
        self._is_sending = False

    @property
    def is_busy(self) -> bool:
        """Running a step (a KV send alone does not count: it takes no core here)."""
        return self._is_busy

    def submit(self, req: SimRequest) -> None:
        self._waiting.append(req)
        self.outstanding_tokens += req.num_remaining
        if not self._is_busy:
            self._start_step()

    def _start_step(self) -> None:
        batch = take_prefill_batch(self._waiting, self.max_batch_tokens)
        self._is_busy = bool(batch)
        if batch:
            tokens = sum(n for _, n in batch)
            attn = sum(chunk_attn_pairs(n, req.num_computed) for req, n in batch)
            self.loop.call_later(step_seconds(self.profile, tokens, attn, 0, 0), self._end_step, batch)

    def _end_step(self, batch: list[tuple[SimRequest, int]]) -> None:
        for req, n in batch:
            req.num_computed += n
            self.outstanding_tokens -= n
        for req, _ in batch:
            if req.num_remaining == 0:
                self._on_prefilled(req, self)
        self._start_step()

    def send(self, seconds: float, on_sent: Callable[[], None]) -> None:
        """Queues a KV transfer of `seconds`; `on_sent` runs when it has arrived."""
        self._sends.append((seconds, on_sent))
        if not self._is_sending:
            self._next_send()

    def _next_send(self) -> None:
        self._is_sending = bool(self._sends)
        if self._sends:
            seconds, on_sent = self._sends.popleft()
            self.loop.call_later(seconds, self._end_send, on_sent)

    def _end_send(self, on_sent: Callable[[], None]) -> None:
        on_sent()
        self._next_send()


class KvBlocks:
    """A worker's KV block pool with up-front reservation and a list of waiters.

    Like DecodeEngine.reserve, a request takes blocks at once when enough are free, even if others
    wait; on each free, waiters are retried in arrival order (a smaller later one may pass a larger)."""

    def __init__(self, capacity_tokens: int, block_size: int):
        self.block_size = block_size
        self.num_total = capacity_tokens // block_size
        self.num_free = self.num_total
        self._waiters: list[tuple[SimRequest, int, Callable[[], None]]] = []
        self._min_waiting = math.inf  # fewest blocks any waiter needs: most frees wake nobody

    def blocks_for(self, req: SimRequest) -> int:
        return -(-(req.input_len + req.output_len) // self.block_size)

    def can_allocate(self, req: SimRequest) -> bool:
        return self.blocks_for(req) <= self.num_free

    def reserve(self, req: SimRequest, then: Callable[[], None]) -> None:
        needed = self.blocks_for(req)
        if needed <= self.num_free:
            req.num_blocks = needed
            self.num_free -= needed
            then()
        else:
            self._waiters.append((req, needed, then))
            self._min_waiting = min(self._min_waiting, needed)

    def free(self, req: SimRequest) -> None:
        self.num_free += req.num_blocks
        req.num_blocks = 0
        if self.num_free < self._min_waiting:
            return
        ready, still = [], []
        for waiter in self._waiters:
            if waiter[1] <= self.num_free:
                waiter[0].num_blocks = waiter[1]
                self.num_free -= waiter[1]
                ready.append(waiter[2])
            else:
                still.append(waiter)
        self._waiters = still
        self._min_waiting = min((w[1] for w in still), default=math.inf)
        for then in ready:
            then()
