"""The prefill gRPC servicer: validate, batch, hold the KV, register it with the broker."""

from __future__ import annotations

import asyncio
import logging
import re
import uuid

import grpc

from distserve import tracing
from distserve.broker_client import BrokerClient
from distserve.convert import finish_to_proto, logprobs_to_proto, sampling_from_proto, starts_to_proto
from distserve.request_types import SamplingParams
from distserve.engine.dtype import torch_dtype
from distserve.model_spec import ModelSpec, prompt_error
from distserve.metrics import PrefillMetrics
from distserve.transfer.connector import KvProducer
from distserve.v1 import common_pb2, kvbroker_pb2, prefill_pb2, prefill_pb2_grpc
from distserve.engine.prefill_batcher import PrefillBatcher, PrefillResult, QueueFull, QueueTimeout
from services.prefill.config import PrefillConfig
from services.prefill.held_kv import HeldKv

log = logging.getLogger(__name__)


HANDLE_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
MIN_KV_SECRET_CHARS = 16  # the router mints 32 hex characters (128 bits) per request


class PrefillServicer(prefill_pb2_grpc.PrefillServiceServicer):
    def __init__(self, config: PrefillConfig, spec: ModelSpec, dtype_name: str, batcher: PrefillBatcher,
                 held: HeldKv, sender: KvProducer, broker: BrokerClient,
                 ucx_address: str, metrics: PrefillMetrics):
        self._config = config
        self._spec = spec
        self._dtype_name = dtype_name
        self._batcher = batcher
        self._held = held
        self._sender = sender
        self._broker = broker
        self._ucx_address = ucx_address
        self._metrics = metrics

    async def Prefill(self, request, context):
        response = prefill_pb2.PrefillResponse()
        async for part in self.PrefillStream(request, context):
            response.MergeFrom(part)
        return response

    async def PrefillStream(self, request, context):
        """The first token as soon as it is sampled, then the registered KV handle (proto comment)."""
        rid = request.request_id
        with tracing.server_context(context), tracing.span("prefill", rid, **{
                "gen_ai.operation.name": "text_completion", "gen_ai.usage.input_tokens": len(request.prompt_token_ids),
                "distserve.worker": self._config.resolved_worker_id}):
            prompt, params, next_token = await self._validated(request, context)
            await self._refuse_if_held_kv_full(len(prompt), context)
            tracing.current_span().set_attributes({  # what it queues behind, for `distserve explain`
                "distserve.prefill.queue.prompts_ahead": self._batcher.num_waiting + self._batcher.num_running,
                "distserve.prefill.queue.tokens_ahead": self._batcher.outstanding_tokens})
            try:
                result = await self._batcher.submit(prompt, params, next_token, max(request.n, 1))
            except QueueFull as exc:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
            except QueueTimeout as exc:
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(exc))
            self._record(rid, len(prompt), result)
            response = prefill_pb2.PrefillResponse(
                request_id=rid, first_token_id=result.first_token, finish_reason=finish_to_proto(result.finish_reason),
                timings=common_pb2.Timings(queue_s=result.queue_s, prefill_s=result.prefill_s),
                num_cached_tokens=result.num_cached_tokens)
            if result.first_token_logprobs is not None:
                response.first_token_logprobs.CopyFrom(logprobs_to_proto(result.first_token_logprobs))
            response.prompt_logprobs.extend(map(logprobs_to_proto, result.prompt_logprobs or ()))
            response.starts.extend(starts_to_proto(result.starts))
            yield response  # the router streams the first token while the KV is registered
            if all(finish is not None for finish in [s.finish for s in result.starts] or [result.finish_reason]):
                return  # no completion goes on to decode: no KV to hold
            kv_part = prefill_pb2.PrefillResponse(kv_handle_id=request.kv_handle_id or uuid.uuid4().hex,
                                                  kv_layout=self._layout(len(prompt), result.kv))
            await self._register(request, kv_part, result.kv, context)
            yield kv_part

    async def _validated(self, request, context) -> tuple[list[int], SamplingParams, int | None]:
        """The tokens to prefill, the sampling parameters, and the known next token of a migrated
        request (output_token_ids set: the KV covers prompt + output_token_ids[:-1]); aborts with
        INVALID_ARGUMENT naming the field."""
        params = sampling_from_proto(request.sampling)
        outputs = list(request.output_token_ids)
        tokens = list(request.prompt_token_ids) + outputs[:-1]
        error = prompt_error(request.prompt_token_ids, self._spec) or prompt_error(tokens, self._spec)
        if outputs and not error:
            error = prompt_error(outputs, self._spec)
            error = error and error.replace("prompt_token_ids", "output_token_ids")
        if request.kv_handle_id and not HANDLE_ID.fullmatch(request.kv_handle_id):
            error = "kv_handle_id: must be 1 to 64 characters of [A-Za-z0-9_-]"
        if not error and len(request.kv_secret) < MIN_KV_SECRET_CHARS:
            error = (f"kv_secret: must be at least {MIN_KV_SECRET_CHARS} characters (the router mints 32 per "
                     f"request): whoever presents it may pull this prompt's KV")
        if not error and request.n > 1 and outputs:
            error = "n: a migrated request (output_token_ids set) continues one completion"
        if error or params.max_tokens <= 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, error or "sampling.max_tokens: must be > 0")
        return tokens, params, (outputs[-1] if outputs else None)

    def _record(self, rid: str, num_tokens: int, result: PrefillResult) -> None:
        """Stage spans, metrics and the log line for one finished prefill."""
        tracing.record_span("queue", rid, result.enqueued_ns, result.forward_start_ns)
        tracing.record_span("forward", rid, result.forward_start_ns, result.forward_end_ns, **{
            "distserve.batch.size": result.batch_size, "distserve.batch.tokens": result.batch_tokens,
            "distserve.prefill.chunks": result.num_chunks, "distserve.prefill.cached_tokens": result.num_cached_tokens})
        tracing.record_span("first_token", rid, result.forward_end_ns, result.sampled_ns, **{
            "distserve.token_id": result.first_token})
        self._metrics.queue_time.observe(result.queue_s)
        self._metrics.prefill_time.observe(result.prefill_s)
        self._metrics.prompt_tokens.inc(num_tokens)
        self._metrics.batch_tokens.observe(result.batch_tokens)
        log.info("prefill request_id=%s tokens=%d cached=%d batch=%d queue_s=%.4f prefill_s=%.4f", rid, num_tokens,
                 result.num_cached_tokens, result.batch_size, result.queue_s, result.prefill_s)

    def _layout(self, num_tokens: int, kv) -> common_pb2.KvLayout:
        return common_pb2.KvLayout(
            num_layers=self._spec.num_layers, num_kv_heads=self._spec.num_kv_heads,
            head_dim=self._spec.head_dim, num_tokens=num_tokens, dtype=self._dtype_name,
            num_bytes=kv.numel() * kv.element_size(),
        )

    async def _refuse_if_held_kv_full(self, num_tokens: int, context) -> None:
        """Fails fast, before the forward, when this prompt's KV would not fit under the held-KV cap."""
        num_bytes = num_tokens * self._spec.kv_bytes_per_token(torch_dtype(self._dtype_name))
        if not self._held.can_hold(num_bytes):
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, self._held_kv_full_message(num_bytes))

    def _held_kv_full_message(self, num_bytes: int) -> str:
        return (f"held KV is full: {self._held.num_bytes} bytes held, cap {self._held.max_bytes}; "
                f"this prompt needs {num_bytes}")

    async def _register(self, request, response, kv, context) -> None:
        """Holds the KV with the request's secret and checksum, then records the handle (the checksum
        but never the secret goes to the broker); undoes both if registration fails."""
        handle_id, request_id = response.kv_handle_id, request.request_id
        crc32c = await self._hold(handle_id, kv, request.kv_secret, context)
        chunks = self._held.chunk_checksums(handle_id)
        handle = kvbroker_pb2.KvHandle(
            handle_id=handle_id, request_id=request_id, owner_worker_id=self._config.resolved_worker_id,
            owner_ucx_address=self._ucx_address, layout=response.kv_layout,
            kv_crc32c=crc32c, kv_chunk_crc32c=chunks.crcs, kv_chunk_tokens=chunks.chunk_tokens,
        )
        try:
            await self._broker.register(handle, self._config.kv_lease_s)
        except asyncio.CancelledError:
            self._held.free(handle_id)
            self._broker.release_soon(handle_id, "cancelled", request_id)  # the record may have been written
            raise
        except grpc.aio.AioRpcError as exc:
            self._held.free(handle_id)
            if exc.code() == grpc.StatusCode.ALREADY_EXISTS:  # another request's handle: never release it
                await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"kv_handle_id {handle_id}: {exc.details()}")
            # Not UNAVAILABLE: to the router that means "this prefill worker is unreachable", and a
            # healthy worker must not be skipped because the broker is down.
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"kvbroker register failed: {exc.details()}")

    async def _hold(self, handle_id: str, kv, secret: str, context) -> int:
        """Holds the KV for pullers presenting `secret`; returns its CRC32C. Aborts if the id is held
        here already or the KV does not fit under the cap."""
        if self._held.is_holding(handle_id):
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"kv_handle_id {handle_id}: already held here")
        num_bytes = kv.numel() * kv.element_size()
        if not self._held.can_hold(num_bytes):  # others filled the cap while this prompt ran
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, self._held_kv_full_message(num_bytes))
        return self._held.add(handle_id, kv, self._config.kv_lease_s, secret)

    async def GetPrefillStats(self, request, context):
        return prefill_pb2.GetPrefillStatsResponse(
            worker_id=self._config.resolved_worker_id,
            kv_bytes_sent=self._sender.counters.num_bytes,
            kv_transfers_sent=self._sender.counters.num_transfers,
            num_held_handles=self._held.num_held, held_bytes=self._held.num_bytes,
            num_waiting=self._batcher.num_waiting, num_batches=self._batcher.num_batches,
            max_batch_size=self._batcher.max_batch_size,
        )
