"""The colocated engine: one worker prefills and decodes, in one loop over one model.

A request's lifecycle: waiting (prompt queued in the PrefillBatcher) -> prefilling (one or more
chunks) -> first token -> KV handed to the paged cache (in process, one copy) -> decoding (the
DecodeEngine's running batch) -> finished.

Each step is one fused forward (ModelRunner.step): every running sequence's next token, plus
prompt chunks under the token budget, as vLLM's chunked prefill does. Decoding sequences go first,
so a long prompt costs them a longer step, never a skipped one; the budget (the saturation length)
bounds how much longer. The decoding rows ride on top of the budget rather than out of it: taken
out of it, a prompt of exactly the budget ran as two forwards, the second shared with the next
prompt's head, and so did every prompt queued behind it (each one's first token a forward late).
The batcher and decode engine keep their own policies and bookkeeping; this loop only drives both
with one forward. The batcher also reads cached prefixes from the decode engine's paged cache
(distserve.engine.paged_prefix), where a chat's earlier turns and their answers are.
"""

from __future__ import annotations

import asyncio
import logging
import time

from distserve.engine.decode_engine import DecodeEngine
from distserve.engine.paged_prefix import PagedPrefix
from distserve.engine.prefill_batcher import PrefillBatcher, PrefillResult
from distserve.engine.sequence import Sequence

log = logging.getLogger(__name__)


class ColocatedEngine:
    def __init__(self, prefill: PrefillBatcher, decode: DecodeEngine, wakeup: asyncio.Event):
        """`prefill` and `decode` must share the runner and were built with this `wakeup` event."""
        self.prefill = prefill
        self.decode = decode
        self._wakeup = wakeup
        self.compute = decode.compute  # one forward thread for the worker (see distserve.engine.compute_thread)
        self.num_steps = 0
        if decode.shared_blocks is not None:
            prefill.add_prefix_source(PagedPrefix(decode.shared_blocks, decode.kv_cache.storage, decode.prefix))

    @property
    def max_batch_tokens(self) -> int:
        return self.prefill.max_batch_tokens

    def hand_off(self, result: PrefillResult, seq: Sequence) -> None:
        """Writes a prefilled prompt's KV into the sequence's reserved blocks and starts decoding it."""
        shared = self.decode.share_cached_prefix(seq, result.kv.shape[2])
        self.decode.load_prompt(seq, result.kv, shared_tokens=shared)
        seq.loaded_at = time.monotonic()
        self.decode.add(seq)

    async def run(self) -> None:
        """Steps while either side has work; runs until cancelled."""
        while True:
            await self._wakeup.wait()
            decoding = self.decode.begin()
            chunks = self.prefill.take_batch(self.max_batch_tokens)
            if not decoding and not chunks:
                if not self.decode.scheduler.has_work():
                    self._wakeup.clear()
                continue
            if chunks:
                self.prefill.begin(chunks)
            started = time.perf_counter()
            try:
                results, sampled = await self.compute.run(self._step, chunks, decoding)
            except Exception as exc:  # a failed step fails its requests, not the worker
                self.prefill.fail(chunks, exc)
                if decoding:
                    self.decode.fail(decoding, exc)
                continue
            self._observe_cost(time.perf_counter() - started, chunks, decoding)
            self.num_steps += 1
            self.prefill.deliver(chunks, results)
            if decoding:
                self.decode.postprocess(decoding, sampled)

    def _observe_cost(self, seconds: float, chunks, decoding: list[Sequence]) -> None:
        """Feeds each side's cost meter from the steps that were that side's alone: a fused step's
        time cannot be split between its prompt tokens and its decoding rows."""
        if not decoding:
            self.prefill.cost.observe(seconds, sum(c.num_tokens for c in chunks))
        elif not chunks:
            self.decode.cost.observe(seconds, len(decoding))

    def _step(self, chunks, decoding: list[Sequence]):
        """The fused forward, then first tokens for finishing prompts and next tokens for decoding ones."""
        started, start_ns = time.monotonic(), time.time_ns()
        works = self.prefill.works(chunks, started, start_ns)
        work = self.decode.work(decoding) if decoding else None
        prompt_logits, decode_logits = self.decode.runner.step(works, work)
        results = self.prefill.finish(chunks, prompt_logits)
        sampled = self.decode.sample(decoding, decode_logits) if decoding else ([], [])
        return results, sampled
