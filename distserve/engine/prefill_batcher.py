"""Prefill batching: packed, chunked batches under a token budget.

A prompt's lifecycle: waiting -> (one or more chunks) -> done. Each forward packs up to
`max_batch_tokens` prompt tokens (the saturation length) with no padding:
  1. in arrival order, every waiting prompt whose remaining tokens fit the budget left;
  2. then the budget that is left goes, as chunks, to the prompts that did not fit.
So one long prompt is prefilled in chunks beside short ones instead of stalling them, and a
prompt skipped `MAX_SKIPS` times in a row goes first, so none starves. Each prompt's KV is
written once, into its own buffer [L, 2, T, Hkv, D], which is what gets sent to decode.

With a prefix cache (distserve.engine.prefix_cache), a prompt's longest cached run of full blocks is
looked up and pinned when it arrives, and looked up again before each batch while no chunk has
started on it and blocks were stored since: those tokens count as computed, so only the rest is
scheduled. So prompts that arrive together with a shared prefix compute it once: the first one's
chunks are stored as they finish, and the others, still waiting, find them. A prompt's first chunk
copies its cached prefix into the buffer (and unpins it). Prompts that ask for prompt logprobs
compute every token (their logits are wanted). A colocated engine adds its paged cache as a second
source (distserve.engine.paged_prefix), which also holds earlier answers; a prompt copies the longer run.
The forward runs in a worker thread so the event loop keeps serving gRPC and UCX meanwhile.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import TYPE_CHECKING, Any

import torch

from distserve.engine.compute_thread import ComputeThread
from distserve.engine.cost_meter import CostMeter
from distserve.engine.core_turns import CoreTurns, NoTurns
from distserve.engine.grammars import LazyGrammarCompiler
from distserve.engine.logprobs import rows_logprobs, token_logprobs
from distserve.engine.model_runner import ModelRunner, PrefillWork
from distserve.engine.prefix_cache import CachedPrefix, PrefixCache
from distserve.engine.sampling import banned_token_ids, finish_reason_for, sample_token
from distserve.request_types import FinishReason, SamplingParams, TokenLogprobs, completion_params

if TYPE_CHECKING:
    from distserve.engine.structured import GrammarState

MAX_SKIPS = 4

# Prompt tokens at which one forward saturates a CPU core (tokens/s stops growing): measured 128-256
# in bfloat16 and ~256 in float32 for the default model (benchmarks/results/engine_roofline_*.json).
# Batching beyond it only delays every prompt in the batch.
CPU_SATURATION_TOKENS_PER_THREAD = 256
CUDA_SATURATION_TOKENS = 8192


def saturation_tokens(device: str) -> int:
    """The default prefill token budget for a device (the DistServe saturation length Lm)."""
    if device.startswith("cuda"):
        return CUDA_SATURATION_TOKENS
    return CPU_SATURATION_TOKENS_PER_THREAD * torch.get_num_threads()


class QueueFull(RuntimeError):
    """The prompt would take the queue past its token cap: refused at once, so load beyond what the
    worker can serve is turned away instead of queueing without bound."""


class QueueTimeout(RuntimeError):
    """The prompt waited in the queue longer than its deadline without a forward starting on it."""


@dataclasses.dataclass
class PrefillResult:
    first_token: int
    finish_reason: FinishReason | None
    kv: torch.Tensor  # [L, 2, T, Hkv, D], token-major, on the CPU (sent host-staged)
    queue_s: float
    prefill_s: float  # first chunk's forward start -> last chunk's forward end
    # wall-clock stage boundaries (ns) for tracing: enqueued -> forward start -> forward end -> sampled
    enqueued_ns: int
    forward_start_ns: int
    forward_end_ns: int
    sampled_ns: int
    batch_size: int  # prompts in the last chunk's forward
    batch_tokens: int  # packed tokens in the last chunk's forward
    num_chunks: int
    first_token_logprobs: TokenLogprobs | None = None  # when params.logprobs is set
    prompt_logprobs: list[TokenLogprobs] | None = None  # positions 1.. of the prompt, when asked for
    starts: list[Start] = dataclasses.field(default_factory=list)  # n > 1: every completion's first token
    grammar: GrammarState | None = None  # the first completion's grammar state, past its first token
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache, not computed


@dataclasses.dataclass(frozen=True)
class Start:
    """A completion's first token, sampled from the prompt's last logits."""

    token: int
    finish: FinishReason | None
    logprobs: TokenLogprobs | None = None
    grammar: GrammarState | None = None  # when the output is constrained: past this token


@dataclasses.dataclass
class _Pending:
    prompt: list[int]
    params: SamplingParams
    future: asyncio.Future
    enqueued_at: float = dataclasses.field(default_factory=time.monotonic)
    enqueued_ns: int = dataclasses.field(default_factory=time.time_ns)
    kv: torch.Tensor | None = None  # allocated at the first chunk
    num_computed: int = 0  # prompt tokens whose KV is in kv
    num_chunks: int = 0
    num_skipped: int = 0  # consecutive batches this prompt waited through
    started_at: float = 0.0
    started_ns: int = 0
    next_token: int | None = None  # known already (a migrated request): returned instead of sampling
    num_completions: int = 1  # n: completions started from this prompt (completion i seeded seed + i)
    prompt_logprobs: list[TokenLogprobs] | None = None  # grows chunk by chunk when params.prompt_logprobs is set
    # per prefix source (PrefillBatcher.prefix_sources, in order), the keys of the prompt's full blocks
    block_keys: list[list[bytes]] = dataclasses.field(default_factory=list)
    cached: CachedPrefix | None = None  # pinned until the first chunk copies it into kv
    num_cached_tokens: int = 0
    looked_up_at: tuple[int, ...] | None = None  # the sources' versions at the last look-up (None: never)
    grammar: Any = None  # params.structured compiled (xgrammar CompiledGrammar) before the prompt queued

    @property
    def num_remaining(self) -> int:
        return len(self.prompt) - self.num_computed


@dataclasses.dataclass
class _Slice:
    """num_tokens of a pending prompt's remaining tokens, scheduled into one forward."""

    pending: _Pending
    num_tokens: int
    is_last: bool = False  # the slice ends its prompt; fixed at scheduling, before num_computed moves
    work: PrefillWork | None = None  # the runner's view, set by PrefillBatcher.works

    def __post_init__(self) -> None:
        self.is_last = self.num_tokens == self.pending.num_remaining


class PrefillBatcher:
    def __init__(self, runner: ModelRunner, eos_ids: tuple[int, ...], max_context: int, max_batch_tokens: int,
                 wakeup: asyncio.Event | None = None, max_queued_tokens: int = 0, queue_timeout_s: float = 0.0,
                 grammars: LazyGrammarCompiler | None = None, turns: CoreTurns | NoTurns = NoTurns(),
                 prefix_cache: PrefixCache | None = None):
        """`wakeup` is set whenever a prompt arrives (pass a shared one when another loop, such as
        the colocated engine's, drives this batcher instead of `run`). `max_queued_tokens` caps the
        outstanding prompt tokens (QueueFull beyond it; 0: no cap); a prompt no forward has started on
        within `queue_timeout_s` fails with QueueTimeout (0: no deadline). Each forward runs in one of
        `turns`' turns (cores shared with other workers; see distserve.engine.core_turns). With
        `prefix_cache`, cached prompt prefixes are reused (see the module docstring); None: off."""
        self.max_queued_tokens = max_queued_tokens
        self.queue_timeout_s = queue_timeout_s
        self._runner = runner
        self._eos_ids = eos_ids
        self._max_context = max_context
        self._grammars = grammars  # builds grammar states for constrained requests (None: refused)
        self.turns = turns
        self.prefix_cache = prefix_cache
        self.prefix_sources: list[Any] = [prefix_cache] if prefix_cache is not None else []
        self.compute = ComputeThread("prefill-forward")
        self.max_batch_tokens = max_batch_tokens
        self._waiting: list[_Pending] = []
        self._wakeup = wakeup or asyncio.Event()
        self.num_batches = 0
        self.max_batch_size = 0
        self.num_running_tokens = 0
        self.num_running = 0
        self.cost = CostMeter()  # seconds per prompt token, published for the router

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def outstanding_tokens(self) -> int:
        return self.num_running_tokens + sum(p.num_remaining for p in self._waiting)

    def prefix_load(self) -> dict[str, int]:
        """What a router needs to estimate this worker's cache hits (distserve.prefix_index): its block
        size and capacity in blocks; empty with the cache off."""
        cache = self.prefix_cache
        return {} if cache is None else {"prefix_block_size": cache.block_size, "prefix_cache_blocks": cache.num_blocks}

    async def submit(self, prompt: list[int], params: SamplingParams, next_token: int | None = None,
                     num_completions: int = 1) -> PrefillResult:
        """Queues a prompt and waits for its result; cancelling drops it from the queue.

        With `next_token` (a migrated request: `prompt` is the prompt plus the completion so far, less
        the last token) nothing is sampled: the result's first token is `next_token`, unfinished.
        With num_completions > 1, result.starts has each completion's first token (see completion_params).
        Raises QueueFull at once when the queue is at its cap (an empty queue takes any prompt)."""
        queued = self.outstanding_tokens
        if self.max_queued_tokens and queued and queued + len(prompt) > self.max_queued_tokens:
            raise QueueFull(f"prefill queue is full: {queued} prompt tokens outstanding, cap {self.max_queued_tokens}")
        pending = _Pending(prompt, params, asyncio.get_running_loop().create_future(), next_token=next_token,
                           num_completions=num_completions)
        if params.structured is not None and self._grammars is not None and next_token is None:
            # Compiled here, off the forward thread: a slow compile holds this prompt back, not the batch.
            pending.grammar = await asyncio.to_thread(self._grammars.compiled, params.structured)
        self._reuse_cached_prefix(pending, self._source_versions())
        self._waiting.append(pending)
        self._wakeup.set()
        return await pending.future

    def add_prefix_source(self, source: Any) -> None:
        """Another place prompts' KV may be cached in, with PrefixCache's lookup/load/release/keys/version
        (distserve.engine.paged_prefix: a colocated worker's paged cache, which also holds answers)."""
        self.prefix_sources.append(source)

    def _source_versions(self) -> tuple[int, ...]:
        return tuple(source.version for source in self.prefix_sources)

    def _reuse_cached_prefix(self, pending: _Pending, versions: tuple[int, ...]) -> None:
        """(Re)pins the longest cached prefix any source holds of a prompt no chunk has started on, unless
        none stored blocks since its last look-up (`versions`: the sources' versions now); the prefix's
        tokens then count as computed."""
        sources = self.prefix_sources
        if not sources or pending.kv is not None or pending.looked_up_at == versions:
            return
        if pending.looked_up_at is None:
            pending.block_keys = [source.keys(pending.prompt, pending.params.cache_salt) for source in sources]
        pending.looked_up_at = versions
        if pending.params.prompt_logprobs is not None:
            return
        found = [source.lookup(keys, len(pending.prompt)) for source, keys in zip(sources, pending.block_keys)]
        best = max(found, key=lambda prefix: prefix.num_tokens)  # the first source's on a tie
        for prefix in found:
            if prefix is not best:
                prefix.source.release(prefix)
        previous, pending.cached = pending.cached, best
        if previous is not None:  # after the new look-up, so blocks in both stay pinned throughout
            previous.source.release(previous)
        pending.num_computed = pending.num_cached_tokens = best.num_tokens

    @staticmethod
    def _unpin(pending: _Pending) -> None:
        if pending.cached is not None:
            pending.cached.source.release(pending.cached)
            pending.cached = None

    def take_batch(self, budget: int) -> list[_Slice]:
        """Picks the next forward's slices, at most `budget` tokens (see the module docstring);
        prompts whose last chunk is taken leave the queue."""
        self._expire_waiting()
        for pending in self._waiting:
            if pending.future.done():  # cancelled or expired before its first chunk
                self._unpin(pending)
        self._waiting = [p for p in self._waiting if not p.future.done()]
        versions = self._source_versions()
        for pending in self._waiting:
            self._reuse_cached_prefix(pending, versions)
        order = sorted(self._waiting, key=lambda p: p.num_skipped < MAX_SKIPS)  # stable: starving first
        taken = {}
        for pending in order:  # whole prompts that fit; a starving one takes what it can
            if pending.num_remaining <= budget or (pending.num_skipped >= MAX_SKIPS and budget):
                taken[id(pending)] = _Slice(pending, min(pending.num_remaining, budget))
                budget -= taken[id(pending)].num_tokens
        for pending in order:  # the rest of the budget as chunks
            if budget and id(pending) not in taken:
                taken[id(pending)] = _Slice(pending, min(pending.num_remaining, budget))
                budget -= taken[id(pending)].num_tokens
        batch = [taken[id(p)] for p in self._waiting if id(p) in taken]
        for pending in self._waiting:
            pending.num_skipped = 0 if id(pending) in taken else pending.num_skipped + 1
        self._waiting = [p for p in self._waiting if id(p) not in taken or not taken[id(p)].is_last]
        return batch

    def _expire_waiting(self) -> None:
        """Fails the prompts that waited past the queue deadline with no chunk computed (a cached prefix is
        not one)."""
        if not self.queue_timeout_s:
            return
        now = time.monotonic()
        for pending in self._waiting:
            waited = now - pending.enqueued_at
            computing = pending.num_computed > pending.num_cached_tokens
            if not computing and waited > self.queue_timeout_s and not pending.future.done():
                pending.future.set_exception(QueueTimeout(
                    f"waited {waited:.1f}s in the prefill queue (deadline {self.queue_timeout_s:g}s)"))

    async def run(self) -> None:
        """The batching loop; runs until cancelled."""
        while True:
            await self._wakeup.wait()
            batch = self.take_batch(self.max_batch_tokens)
            if not batch:
                self._wakeup.clear()
                continue
            self.begin(batch)
            started = time.perf_counter()
            try:
                results = await self.compute.run(self._forward, batch)
            except Exception as exc:  # a failed forward fails its requests, not the worker
                self.fail(batch, exc)
                continue
            self.cost.observe(time.perf_counter() - started, sum(s.num_tokens for s in batch))
            self.deliver(batch, results)

    def begin(self, batch: list[_Slice]) -> None:
        """Counts a taken batch as running (for load reports) until `deliver` or `fail`."""
        self.num_batches += 1
        self.max_batch_size = max(self.max_batch_size, len(batch))
        self.num_running_tokens = sum(s.num_tokens for s in batch)
        self.num_running = len(batch)

    def deliver(self, batch: list[_Slice], results: list[PrefillResult | Exception]) -> None:
        """Hands each finishing prompt its result (from `finish`)."""
        self.num_running_tokens = self.num_running = 0
        for piece, result in zip([s for s in batch if s.is_last], results):
            if isinstance(result, Exception):
                self._fail(piece.pending, result)
            elif not piece.pending.future.done():
                piece.pending.future.set_result(result)

    def fail(self, batch: list[_Slice], exc: Exception) -> None:
        """A failed forward fails its batch's requests, not the worker."""
        self.num_running_tokens = self.num_running = 0
        for piece in batch:
            self._fail(piece.pending, exc)

    def _fail(self, pending: _Pending, exc: Exception) -> None:
        self._unpin(pending)
        if pending in self._waiting:
            self._waiting.remove(pending)
        if not pending.future.done():
            pending.future.set_exception(exc)

    def _forward(self, batch: list[_Slice]) -> list[PrefillResult | Exception]:
        """Runs the batch; returns a result (or that prompt's sampling error) per finishing prompt."""
        with self.turns.turn():
            started, start_ns = time.monotonic(), time.time_ns()  # a wait for the cores counts as queueing
            logits = self._runner.prefill_chunks(self.works(batch, started, start_ns))
            return self.finish(batch, logits)

    def works(self, batch: list[_Slice], started: float, start_ns: int) -> list[PrefillWork]:
        """The runner's view of a batch; a prompt's KV buffer is allocated at its first chunk."""
        works = []
        for piece in batch:
            pending = piece.pending
            if pending.kv is None:
                pending.kv = self._runner.new_kv_buffer(len(pending.prompt))
                pending.started_at, pending.started_ns = started, start_ns
                if pending.cached is not None:
                    pending.cached.source.load(pending.cached, pending.kv)
                    if self.prefix_cache is not None:
                        self.prefix_cache.count_query(len(pending.prompt), pending.num_cached_tokens)
                    self._unpin(pending)
            begin = pending.num_computed
            piece.work = PrefillWork(pending.prompt[begin:begin + piece.num_tokens], begin, pending.kv, piece.is_last,
                                     wants_all_logits=pending.params.prompt_logprobs is not None)
            works.append(piece.work)
        return works

    def finish(self, batch: list[_Slice], logits: torch.Tensor) -> list[PrefillResult | Exception]:
        """After the forward: advances every prompt, samples each finishing prompt's first token from
        its row of logits [num finishing, V]."""
        finishing = [s for s in batch if s.is_last]
        ended, end_ns = time.monotonic(), time.time_ns()
        for piece in batch:
            if piece.work is not None and piece.work.all_logits is not None:
                self._add_prompt_logprobs(piece)
            piece.pending.num_computed += piece.num_tokens
            piece.pending.num_chunks += 1
            if self.prefix_cache is not None:  # every block this chunk completed, for prompts still waiting
                keys = piece.pending.block_keys[0]  # the prefix cache is the first source
                self.prefix_cache.store(keys[:piece.pending.num_computed // self.prefix_cache.block_size],
                                        piece.pending.kv)
        num_tokens = sum(s.num_tokens for s in batch)
        return [self._result(s.pending, logits[row], ended, end_ns, len(batch), num_tokens)
                for row, s in enumerate(finishing)]

    @staticmethod
    def _add_prompt_logprobs(piece: _Slice) -> None:
        """Logprobs of the prompt tokens this chunk's logits predict: row j (position begin + j) predicts
        the token at begin + j + 1; the prompt's last row predicts the first completion token instead."""
        pending, begin = piece.pending, piece.pending.num_computed
        targets = pending.prompt[begin + 1:begin + piece.num_tokens + 1]
        entries = rows_logprobs(piece.work.all_logits[:len(targets)], targets, pending.params.prompt_logprobs)
        pending.prompt_logprobs = (pending.prompt_logprobs or []) + entries

    def _result(self, pending: _Pending, logits: torch.Tensor, ended: float, end_ns: int, batch_size: int,
                batch_tokens: int) -> PrefillResult | Exception:
        params = pending.params
        if pending.next_token is not None:
            return self._packaged(pending, pending.next_token, None, ended, end_ns, batch_size, batch_tokens)
        try:
            starts = [self._start(logits, completion_params(params, i), pending.prompt, pending.grammar)
                      for i in range(pending.num_completions)]
        except Exception as exc:  # e.g. non-finite probabilities: fails this request only
            return exc
        result = self._packaged(pending, starts[0].token, starts[0].finish, ended, end_ns, batch_size, batch_tokens)
        result.first_token_logprobs, result.grammar = starts[0].logprobs, starts[0].grammar
        result.prompt_logprobs = pending.prompt_logprobs
        if len(starts) > 1:
            result.starts = starts
        return result

    def _start(self, logits: torch.Tensor, params: SamplingParams, prompt: list[int], compiled: Any) -> Start:
        """Samples a completion's first token from the prompt's last logits [V] (left unmodified); a
        constrained one from the tokens its grammar (compiled: params.structured's, compiled at submit)
        allows."""
        grammar, allowed = None, logits
        if params.structured is not None:
            from distserve.engine.structured import mask_logits  # xgrammar loads with the first grammar
            if self._grammars is None:
                raise ValueError("structured_output: this worker has no grammar compiler")
            grammar = self._grammars.matcher(compiled if compiled is not None else params.structured)
            allowed = logits[None].clone()  # [1, V]
            mask_logits(allowed, [grammar])
            allowed = allowed[0]
        token = sample_token(allowed, params, 0, banned_token_ids(params, self._eos_ids, 0, grammar is not None),
                             prompt_token_ids=prompt, output_token_ids=())
        if grammar is not None:
            grammar.accept(token)
        finish = finish_reason_for(token, 1, len(prompt) + 1, params, self._eos_ids, self._max_context,
                                   grammar is not None and grammar.is_terminated)
        logprobs = token_logprobs(logits, token, params.logprobs) if params.logprobs is not None else None
        return Start(token, finish, logprobs, grammar)

    @staticmethod
    def _packaged(pending: _Pending, token: int, finish: FinishReason | None, ended: float, end_ns: int,
                  batch_size: int, batch_tokens: int) -> PrefillResult:
        kv = pending.kv if pending.kv.device.type == "cpu" else pending.kv.cpu()  # UCX today is host-staged
        return PrefillResult(token, finish, kv, pending.started_at - pending.enqueued_at,
                             ended - pending.started_at, pending.enqueued_ns, pending.started_ns, end_ns,
                             time.time_ns(), batch_size, batch_tokens, pending.num_chunks,
                             num_cached_tokens=pending.num_cached_tokens)
