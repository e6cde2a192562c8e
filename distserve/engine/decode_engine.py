"""The decode engine loop: schedule -> run one step in a thread -> post tokens.

All scheduler and allocator state is touched only on the event loop; the step
thread reads the batch it was given and writes only those sequences' blocks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

import torch

from distserve.engine.compute_thread import ComputeThread
from distserve.engine.core_turns import CoreTurns, NoTurns
from distserve.engine.cost_meter import CostMeter
from distserve.engine.grammars import LazyGrammarCompiler
from distserve.engine.kv_cache import PagedKvCache
from distserve.engine.logprobs import rows_logprobs
from distserve.request_types import TokenLogprobs
from distserve.engine.model_runner import DecodeWork, ModelRunner
from distserve.engine.sampling import SampleRow, banned_token_ids, finish_reason_for, sample_tokens
from distserve.engine.decode_scheduler import DecodeScheduler
from distserve.engine.sequence import Sequence
from distserve.engine.shared_blocks import SharedBlocks
from distserve.prefix_hash import PrefixNamespace, block_keys

log = logging.getLogger(__name__)


class StepStats:
    """Running totals of decode steps, logged every LOG_EVERY steps: where step time goes."""

    LOG_EVERY = 500

    def __init__(self) -> None:
        self.num_steps = self.num_sequences = 0
        self.wall_s = self.compute_s = 0.0

    def add(self, batch_size: int, wall_s: float, compute_s: float) -> None:
        self.num_steps += 1
        self.num_sequences += batch_size
        self.wall_s += wall_s
        self.compute_s += compute_s
        if self.num_steps % self.LOG_EVERY == 0:
            log.info("decode steps=%d mean_batch=%.1f mean_step_ms=%.2f (in the step thread %.2f)", self.num_steps,
                     self.num_sequences / self.num_steps, self.wall_s / self.num_steps * 1e3,
                     self.compute_s / self.num_steps * 1e3)


# A step's result: a token (or that sequence's error) per sequence, and logprobs where asked for.
Sampled = tuple[list["int | Exception"], list["TokenLogprobs | None"]]


@dataclasses.dataclass(frozen=True)
class EngineUsage:
    """What a decode engine holds, for load reports, stats and metrics."""

    num_blocks: int
    num_used_blocks: int
    num_free_blocks: int  # cached blocks included
    num_cached_blocks: int  # held by no sequence, kept for prompts that start with their tokens
    num_running: int
    num_waiting: int
    max_running_seen: int


class NoCapacity(RuntimeError):
    """A request's KV blocks cannot be had: never on this worker, or not within the wait allowed."""


class DecodeEngine:
    def __init__(self, runner: ModelRunner, kv_cache: PagedKvCache, scheduler: DecodeScheduler,
                 eos_ids: tuple[int, ...], max_context: int, wakeup: asyncio.Event | None = None,
                 grammars: LazyGrammarCompiler | None = None, turns: CoreTurns | NoTurns = NoTurns(),
                 prefix: PrefixNamespace | None = None):
        """`wakeup` is set whenever a sequence arrives or is aborted (pass a shared one when another
        loop, such as the colocated engine's, drives this engine instead of `run`). Each step runs in
        one of `turns`' turns (cores shared with other workers; see distserve.engine.core_turns).
        With `prefix` (its block size the cache's), sequences share the full prompt blocks they have in
        common (see load_prompt); None: each holds its own."""
        self.runner = runner
        self.kv_cache = kv_cache
        self.scheduler = scheduler
        self._eos_ids = eos_ids
        self._max_context = max_context
        self.grammars = grammars  # builds grammar states for constrained sequences (None: refused)
        self.turns = turns
        self.compute = ComputeThread("decode-step")
        self._wakeup = wakeup or asyncio.Event()
        self._blocks_freed = asyncio.Event()
        scheduler.allocator.on_free = self._blocks_freed.set
        self.step_stats = StepStats()
        self._step_compute_s = 0.0
        self.num_reserving = 0  # requests waiting for free blocks
        self.cost = CostMeter()  # seconds per decoded token (a step over its batch), published for the router
        self.prefix = prefix  # the namespace its shared blocks are keyed in (None: no sharing)
        self.shared_blocks = SharedBlocks(scheduler.allocator) if prefix is not None else None

    def share_cached_prefix(self, seq: Sequence, num_tokens: int) -> int:
        """Points the sequence's first blocks at full blocks here that hold the KV of the same first tokens
        of its prompt (of num_tokens), and frees reserved blocks they replace, if any (take them before
        reserving the rest, so that the reservation cannot evict them). Returns the tokens shared: their
        KV need not be pulled (load_prompt writes the rest)."""
        if self.shared_blocks is None:
            return 0
        shared = self.shared_blocks.take(self._keys(seq, num_tokens))
        if shared:
            own = seq.block_table[:len(shared)]  # none when the rest is reserved after this
            seq.block_table = shared + seq.block_table[len(shared):]
            self.scheduler.allocator.free(own)
        return len(shared) * self.kv_cache.block_size

    def load_prompt(self, seq: Sequence, kv: torch.Tensor, kv_start: int = 0, shared_tokens: int = 0) -> None:
        """Writes prompt KV kv [L, 2, T, Hkv, D], the KV of prompt tokens [kv_start, kv_start + T), into the
        sequence's blocks from token shared_tokens on (share_cached_prefix's answer, >= kv_start: the
        shared blocks hold the tokens before), and lists its full blocks for later prompts to share."""
        assert kv_start <= shared_tokens, "the KV must cover every token not shared"
        self.kv_cache.write_tokens(seq.block_table, kv[:, :, shared_tokens - kv_start:], first=shared_tokens)
        if self.shared_blocks is not None:
            keys = self._keys(seq, kv_start + kv.shape[2])
            first = shared_tokens // self.kv_cache.block_size
            self.shared_blocks.add(keys[first:], seq.block_table[first:len(keys)])

    def _keys(self, seq: Sequence, num_tokens: int) -> list[bytes]:
        """The prefix keys of the full blocks of the sequence's first num_tokens tokens. Each block is hashed
        once per sequence: the chain is extended from its last key (seq.block_keys) as the sequence grows."""
        block_size, keys = self.kv_cache.block_size, seq.block_keys
        wanted = num_tokens // block_size
        if len(keys) < wanted:
            parent = keys[-1] if keys else self.prefix.seed(seq.params.cache_salt)
            keys += block_keys(seq.tokens[len(keys) * block_size:wanted * block_size], block_size, parent)
        return keys[:wanted]

    async def reserve(self, num_blocks: int) -> list[int]:
        """Waits until num_blocks are free and takes them (callers bound the wait with a timeout)."""
        allocator = self.scheduler.allocator
        while not allocator.can_allocate(num_blocks):
            self._blocks_freed.clear()
            await self._blocks_freed.wait()
        return allocator.allocate(num_blocks)

    async def reserve_for(self, prompt_len: int, max_tokens: int, timeout_s: float, max_waiting: int = 0,
                          whole_life: bool = False, held_blocks: int = 0) -> list[int]:
        """Blocks for a request (`DecodeScheduler.blocks_for`: its whole life, or its start; always its
        whole life with `whole_life`, e.g. for a request preempted once already, so it cannot be again),
        less the `held_blocks` it holds already (shared), waiting up to timeout_s for them to be free.
        Raises NoCapacity when this cache could never hold it, on timeout, or at once when they are not
        free and `max_waiting` requests already wait (0: no bound)."""
        allocator = self.scheduler.allocator
        whole_life_blocks = self.scheduler.blocks_for_life(prompt_len, max_tokens)
        if whole_life_blocks > allocator.num_blocks:
            raise NoCapacity(f"request needs {whole_life_blocks} KV blocks; this worker has {allocator.num_blocks}")
        needed = whole_life_blocks if whole_life else self.scheduler.blocks_for(prompt_len, max_tokens)
        needed = max(0, needed - held_blocks)
        if max_waiting and self.num_reserving >= max_waiting and not allocator.can_allocate(needed):
            raise NoCapacity(f"KV cache is full: {allocator.num_free} blocks free, {needed} needed, and "
                             f"{self.num_reserving} requests already wait for blocks")
        self.num_reserving += 1
        try:
            return await asyncio.wait_for(self.reserve(needed), timeout_s)
        except asyncio.TimeoutError:
            raise NoCapacity(f"no {needed} free KV blocks in time") from None
        finally:
            self.num_reserving -= 1

    @property
    def tokens_left(self) -> int:
        """Tokens still to decode for the sequences here, at most: each one's max_tokens less what it has."""
        return sum(max(s.params.max_tokens - s.num_generated, 0)
                   for s in (*self.scheduler.running, *self.scheduler.waiting))

    def usage(self) -> EngineUsage:
        allocator, scheduler = self.scheduler.allocator, self.scheduler
        return EngineUsage(allocator.num_blocks, allocator.num_used, allocator.num_free, allocator.num_cached,
                           len(scheduler.running), len(scheduler.waiting), scheduler.max_running_seen)

    def fork_blocks(self, prompt_len: int, max_tokens: int) -> int:
        """Blocks a completion forked from a prompt (n > 1) needs of its own: its whole life less the
        prompt's full blocks, which it shares."""
        return self.scheduler.blocks_for_life(prompt_len, max_tokens) - prompt_len // self.kv_cache.block_size

    def fork(self, parent: Sequence, prompt_len: int, child: Sequence) -> None:
        """Points the child's table (its fork_blocks reserved) at the parent's prompt KV: full blocks shared,
        the partial one copied (see PagedKvCache.fork_table)."""
        child.block_table = self.kv_cache.fork_table(parent.block_table, prompt_len, child.block_table)

    def release(self, seq: Sequence) -> None:
        """Frees the blocks reserved for a sequence that never joined the engine (its request ended first)."""
        self.scheduler.allocator.free(seq.block_table)

    def add(self, seq: Sequence) -> None:
        self.scheduler.add(seq)
        self._wakeup.set()

    def abort(self, seq: Sequence) -> None:
        """Marks a sequence cancelled; its blocks are freed before the next step."""
        seq.is_aborted = True
        self._wakeup.set()

    async def run(self) -> None:
        """Steps while there is work; runs until cancelled."""
        while True:
            await self._wakeup.wait()
            batch = self.begin()
            if batch:
                try:
                    started = time.perf_counter()
                    sampled = await self.compute.run(self._step, batch)
                    self.step_stats.add(len(batch), time.perf_counter() - started, self._step_compute_s)
                    self.cost.observe(time.perf_counter() - started, len(batch))
                except Exception as exc:  # a failed step ends its batch's requests, not the worker
                    self.fail(batch, exc)
                    sampled = None
                if sampled is not None:
                    self.postprocess(batch, sampled)
            if not self.scheduler.has_work():
                self._wakeup.clear()

    def begin(self) -> list[Sequence]:
        """This step's batch (see DecodeScheduler.schedule), each sequence stamped with its start."""
        batch = self.scheduler.schedule()
        now = time.monotonic()
        for seq in batch:
            seq.started_at = seq.started_at or now
            seq.num_steps += 1
            seq.batch_size_sum += len(batch)
        return batch

    def fail(self, batch: list[Sequence], exc: Exception) -> None:
        """A failed step ends its batch's requests, not the worker."""
        log.exception("decode step failed: %r", exc)  # called from the except block
        for seq in batch:
            seq.is_aborted = True
            seq.outputs.put_nowait(exc)

    def _step(self, batch: list[Sequence]) -> "Sampled":
        """One forward for the batch, then a token per sequence (or that sequence's sampling error)."""
        with self.turns.turn():
            started = time.perf_counter()  # after the wait for the cores: step wall - compute = waits
            try:
                return self._forward_and_sample(batch)
            finally:
                self._step_compute_s = time.perf_counter() - started

    def _forward_and_sample(self, batch: list[Sequence]) -> "Sampled":
        work = self.work(batch)
        return self.sample(batch, self.runner.decode(work.kv_cache, work.tables, work.context_lens, work.input_ids))

    def work(self, batch: list[Sequence]) -> DecodeWork:
        """The runner's view of a batch: each sequence's last token at its context length."""
        return DecodeWork(self.kv_cache, [s.block_table for s in batch], [s.context_len for s in batch],
                          [s.tokens[-1] for s in batch])

    def sample(self, batch: list[Sequence], logits: torch.Tensor) -> "Sampled":
        """A token per sequence from logits [B, V] (or that sequence's sampling error), and the
        logprobs of the sequences that asked for them (raw logits: see distserve.engine.logprobs)."""
        wants_logprobs = [b for b, seq in enumerate(batch) if seq.params.logprobs is not None]
        raw = logits[wants_logprobs] if wants_logprobs else None  # [N, V], a copy taken before any mask
        grammars = [seq.grammar for seq in batch]
        if any(g is not None for g in grammars):
            from distserve.engine.structured import mask_logits  # loaded with the first constrained request
            mask_logits(logits, grammars)  # in place: disallowed tokens -inf in constrained rows
        tokens = self._sample_tokens(batch, logits)
        for b, grammar in enumerate(grammars):
            if grammar is not None and not isinstance(tokens[b], Exception):
                try:
                    grammar.accept(tokens[b])
                except Exception as exc:  # cannot happen with a correct mask; fails this sequence only
                    tokens[b] = exc
        logprobs: list[TokenLogprobs | None] = [None] * len(batch)
        for row, b in enumerate(wants_logprobs):  # a row each: sequences ask for their own number of alternatives
            if not isinstance(tokens[b], Exception):
                logprobs[b] = rows_logprobs(raw[row:row + 1], [tokens[b]], batch[b].params.logprobs)[0]
        return tokens, logprobs

    def _sample_tokens(self, batch: list[Sequence], logits: torch.Tensor) -> list[int | Exception]:
        rows = []
        for seq in batch:
            banned = banned_token_ids(seq.params, self._eos_ids, seq.num_generated, seq.grammar is not None)
            history = seq.tokens if seq.params.has_penalties else ()  # no per-step copies without penalties
            rows.append(SampleRow(seq.params, seq.num_generated, banned, history[:seq.prompt_len],
                                  history[seq.prompt_len:]))
        return sample_tokens(logits, rows)

    def postprocess(self, batch: list[Sequence], sampled: "Sampled") -> None:
        tokens, logprobs = sampled
        for seq, token, token_logprobs in zip(batch, tokens, logprobs):
            if seq.is_aborted:
                continue
            if isinstance(token, Exception):
                log.error("sampling failed request_id=%s: %r", seq.request_id, token)
                seq.is_aborted = True
                seq.outputs.put_nowait(token)
                continue
            seq.tokens.append(token)
            seq.finish_reason = finish_reason_for(
                token, seq.num_generated, len(seq.tokens), seq.params, self._eos_ids, self._max_context,
                seq.grammar is not None and seq.grammar.is_terminated)
            seq.outputs.put_nowait(([token], seq.finish_reason, [token_logprobs] if token_logprobs else []))
        if self.shared_blocks is not None:
            for seq in batch:
                if seq.finish_reason is not None and not seq.is_aborted:
                    self._list_generated_blocks(seq)
        for seq in self.scheduler.retire_finished():
            seq.finished_at = time.monotonic()

    def _list_generated_blocks(self, seq: Sequence) -> None:
        """Lists a finishing sequence's full blocks past its prompt's, those whose KV is written (every
        token's but the last sampled one's), so that once freed they stay cached for a prompt that
        continues this text: the next turn of a conversation, which starts with this prompt and answer."""
        block_size = self.kv_cache.block_size
        keys = self._keys(seq, (len(seq.tokens) - 1) // block_size * block_size)
        first = seq.prompt_len // block_size  # the prompt's full blocks were listed when it was loaded
        self.shared_blocks.add(keys[first:], seq.block_table[first:len(keys)])


def build_decode_engine(runner: ModelRunner, spec, dtype: str, device: str, *, block_size: int, kv_cache_mb: int,
                        max_running: int, reserve_ahead_tokens: int = 0, wakeup: asyncio.Event | None = None,
                        grammars: LazyGrammarCompiler | None = None, turns: CoreTurns | NoTurns = NoTurns(),
                        prefix: PrefixNamespace | None = None, gpu_memory_fraction: float = 0.0,
                        max_step_tokens: int = 0, later_device_bytes: int = 0) -> DecodeEngine:
    """A decode engine over `runner` with a paged cache of kv_cache_mb MiB in blocks of block_size tokens
    (`spec`: the model's ModelSpec; `dtype`: the KV dtype's name); on CUDA with gpu_memory_fraction > 0,
    of what that fraction of the GPU leaves after the weights, one step's activations (up to
    max_step_tokens rows, at least max_running: distserve.engine.device_memory) and later_device_bytes
    (what the worker allocates on the device after this, e.g. a prefill half's prefix cache). reserve_ahead_tokens 0:
    every sequence reserves its whole life on arrival, so none is ever preempted. The one place a decode
    side is built, for decode workers and colocated halves alike."""
    from distserve.engine.device_memory import activation_reserve_bytes, kv_cache_budget_mb
    from distserve.engine.kv_cache import blocks_in_budget
    from distserve.engine.dtype import torch_dtype

    kv_cache_mb = kv_cache_budget_mb(kv_cache_mb, device, gpu_memory_fraction, lambda: later_device_bytes + (
        activation_reserve_bytes(runner.model.args, max(max_step_tokens, max_running), torch_dtype(dtype).itemsize)))
    num_blocks = blocks_in_budget(kv_cache_mb, spec.kv_bytes_per_token(torch_dtype(dtype)), block_size)
    kv_cache = PagedKvCache(spec.num_layers, spec.num_kv_heads, spec.head_dim, num_blocks, block_size,
                            torch_dtype(dtype), device)
    scheduler = DecodeScheduler(kv_cache.allocator, block_size, max_running, spec.max_context, reserve_ahead_tokens)
    return DecodeEngine(runner, kv_cache, scheduler, spec.eos_token_ids, spec.max_context, wakeup, grammars, turns,
                        prefix)
