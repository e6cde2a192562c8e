"""Prefill batching: gathers waiting prompts into batches up to a padded-token budget.

Waiting prompts are taken in arrival order while (longest prompt) x (count)
stays within max_batch_tokens, the saturation length; a prompt longer than the
budget runs alone. The forward runs in a worker thread so the event loop keeps
serving gRPC and UCX meanwhile.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import torch

from distserve.engine.model_runner import ModelRunner
from distserve.engine.sampling import (
    FinishReason,
    SamplingParams,
    banned_token_ids,
    finish_reason_for,
    sample_token,
)


@dataclasses.dataclass
class PrefillResult:
    first_token: int
    finish_reason: FinishReason | None
    kv: torch.Tensor  # [L, 2, H, T, D] on the CPU
    queue_s: float
    prefill_s: float
    # wall-clock stage boundaries (ns) for tracing: enqueued -> forward start -> forward end -> sampled
    enqueued_ns: int
    forward_start_ns: int
    forward_end_ns: int
    sampled_ns: int
    batch_size: int
    batch_tokens: int  # padded tokens in the forward


@dataclasses.dataclass
class _Pending:
    prompt: list[int]
    params: SamplingParams
    future: asyncio.Future
    enqueued_at: float = dataclasses.field(default_factory=time.monotonic)
    enqueued_ns: int = dataclasses.field(default_factory=time.time_ns)


class PrefillBatcher:
    def __init__(self, runner: ModelRunner, eos_ids: tuple[int, ...], max_context: int, max_batch_tokens: int):
        self._runner = runner
        self._eos_ids = eos_ids
        self._max_context = max_context
        self._max_batch_tokens = max_batch_tokens
        self._waiting: list[_Pending] = []
        self._wakeup = asyncio.Event()
        self.num_batches = 0
        self.max_batch_size = 0
        self.num_running_tokens = 0
        self.num_running = 0

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def outstanding_tokens(self) -> int:
        return self.num_running_tokens + sum(len(p.prompt) for p in self._waiting)

    async def submit(self, prompt: list[int], params: SamplingParams) -> PrefillResult:
        """Queues a prompt and waits for its result; cancelling drops it from the queue."""
        pending = _Pending(prompt, params, asyncio.get_running_loop().create_future())
        self._waiting.append(pending)
        self._wakeup.set()
        return await pending.future

    def _take_batch(self) -> list[_Pending]:
        self._waiting = [p for p in self._waiting if not p.future.done()]
        batch: list[_Pending] = []
        longest = 0
        for pending in self._waiting:
            longest_with = max(longest, len(pending.prompt))
            if batch and longest_with * (len(batch) + 1) > self._max_batch_tokens:
                break
            batch.append(pending)
            longest = longest_with
        self._waiting = self._waiting[len(batch):]
        return batch

    async def run(self) -> None:
        """The batching loop; runs until cancelled."""
        while True:
            await self._wakeup.wait()
            batch = self._take_batch()
            if not batch:
                self._wakeup.clear()
                continue
            self.num_batches += 1
            self.max_batch_size = max(self.max_batch_size, len(batch))
            self.num_running_tokens = sum(len(p.prompt) for p in batch)
            self.num_running = len(batch)
            try:
                results = await asyncio.to_thread(self._forward, batch)
            except Exception as exc:  # a failed forward fails its requests, not the worker
                for pending in batch:
                    if not pending.future.done():
                        pending.future.set_exception(exc)
                continue
            finally:
                self.num_running_tokens = self.num_running = 0
            for pending, result in zip(batch, results):
                if pending.future.done():
                    continue
                if isinstance(result, Exception):
                    pending.future.set_exception(result)
                else:
                    pending.future.set_result(result)

    def _forward(self, batch: list[_Pending]) -> list[PrefillResult | Exception]:
        started, start_ns = time.monotonic(), time.time_ns()
        logits, kvs = self._runner.prefill([p.prompt for p in batch])
        prefill_s, end_ns = time.monotonic() - started, time.time_ns()
        padded = max(len(p.prompt) for p in batch) * len(batch)
        results: list[PrefillResult | Exception] = []
        for b, pending in enumerate(batch):
            params = pending.params
            try:
                token = sample_token(logits[b], params, 0, banned_token_ids(params, self._eos_ids, 0),
                                     prompt_token_ids=pending.prompt, output_token_ids=())
            except Exception as exc:  # e.g. non-finite probabilities: fails this request only
                results.append(exc)
                continue
            finish = finish_reason_for(token, 1, len(pending.prompt) + 1, params, self._eos_ids, self._max_context)
            results.append(PrefillResult(token, finish, kvs[b], started - pending.enqueued_at, prefill_s,
                                         pending.enqueued_ns, start_ns, end_ns, time.time_ns(), len(batch), padded))
        return results
