"""The colocated gRPC servicer: reserve blocks, prefill, hand the KV to decode in process, stream.

A request's life here: admitted (KV blocks for prompt + max_tokens reserved) -> waiting/prefilling
(the engine's prefill side, chunked) -> first token streamed -> decoding (the running batch) ->
finished / cancelled (blocks freed).
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from distserve import tracing
from distserve.convert import finish_to_proto, first_logprobs_fields, logprobs_to_proto, sampling_from_proto
from distserve.engine.colocated_engine import ColocatedEngine
from distserve.engine.decode_engine import NoCapacity
from distserve.model_spec import ModelSpec, prompt_error
from distserve.mux import MuxServer
from distserve.engine.prefill_batcher import PrefillResult
from distserve.engine.sequence import Sequence, stream_outputs
from distserve.metrics import ColocatedMetrics
from distserve.v1 import colocated_pb2, colocated_pb2_grpc, common_pb2
from services.colocated.config import ColocatedConfig

log = logging.getLogger(__name__)


class ColocatedServicer(colocated_pb2_grpc.ColocatedServiceServicer):
    def __init__(self, config: ColocatedConfig, spec: ModelSpec, engine: ColocatedEngine, metrics: ColocatedMetrics):
        self._config = config
        self._spec = spec
        self._engine = engine
        self._metrics = metrics
        # PrefillAndDecodeMux: those calls over one stream per router; drain_sessions is the server's on_stop.
        self.PrefillAndDecodeMux, self.drain_sessions = MuxServer.methods(
            self.PrefillAndDecode, colocated_pb2.PrefillAndDecodeRequest)

    async def PrefillAndDecode(self, request, context):
        rid = request.request_id
        with tracing.server_context(context), tracing.span("colocated", rid, **{
                "gen_ai.operation.name": "text_completion", "gen_ai.usage.input_tokens": len(request.prompt_token_ids),
                "distserve.worker": self._config.resolved_worker_id}):
            params = sampling_from_proto(request.sampling)
            error = prompt_error(request.prompt_token_ids, self._spec)
            if error or params.max_tokens <= 0:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, error or "sampling.max_tokens: must be > 0")
            prompt = list(request.prompt_token_ids)
            seq = Sequence(rid, prompt, len(prompt), params, [], asyncio.Queue())
            # Blocks holding the prompt's head (a chat's earlier turns) are taken before the reservation,
            # which could otherwise evict them to make room.
            self._engine.decode.share_cached_prefix(seq, len(prompt))
            in_engine = False
            try:
                seq.block_table += await self._reserve_blocks(len(prompt), params.max_tokens, context,
                                                              held_blocks=len(seq.block_table))
                result = await self._engine.prefill.submit(prompt, params)
                self._record_prefill(rid, len(prompt), result)
                yield colocated_pb2.PrefillAndDecodeResponse(
                    token_ids=[result.first_token], finish_reason=finish_to_proto(result.finish_reason),
                    timings=common_pb2.Timings(queue_s=result.queue_s, prefill_s=result.prefill_s),
                    num_cached_tokens=result.num_cached_tokens, **first_logprobs_fields(result))
                if result.finish_reason is not None:
                    return
                seq.tokens.append(result.first_token)
                seq.grammar = result.grammar
                self._engine.hand_off(result, seq)
                in_engine = True
                async for response in self._stream(seq):
                    yield response
                self._record_finish(seq)
            finally:
                if not in_engine:
                    self._engine.decode.release(seq)
                elif seq.finish_reason is None:
                    self._engine.decode.abort(seq)

    async def _reserve_blocks(self, prompt_len: int, max_tokens: int, context, held_blocks: int = 0) -> list[int]:
        """Blocks for the whole request up front, less the `held_blocks` it shares already: a request is
        admitted only when it can finish."""
        try:
            # whole life: never preempted (a decode worker's own sequences reserve ahead and may be)
            return await self._engine.decode.reserve_for(prompt_len, max_tokens, self._config.admission_timeout_s,
                                                        self._config.max_waiting_for_blocks, whole_life=True,
                                                        held_blocks=held_blocks)
        except NoCapacity as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))

    async def _stream(self, seq: Sequence):
        async for token_ids, finish, logprobs in stream_outputs(seq):
            response = colocated_pb2.PrefillAndDecodeResponse(token_ids=token_ids,
                                                              finish_reason=finish_to_proto(finish),
                                                              logprobs=[logprobs_to_proto(e) for e in logprobs])
            self._metrics.generation_tokens.inc(len(token_ids))
            if finish is not None:
                response.timings.CopyFrom(common_pb2.Timings(decode_queue_s=seq.started_at - seq.loaded_at,
                                                             decode_s=seq.finished_at - seq.started_at))
            yield response

    def _record_prefill(self, rid: str, num_tokens: int, result: PrefillResult) -> None:
        tracing.record_span("queue", rid, result.enqueued_ns, result.forward_start_ns)
        tracing.record_span("forward", rid, result.forward_start_ns, result.forward_end_ns, **{
            "distserve.batch.size": result.batch_size, "distserve.batch.tokens": result.batch_tokens,
            "distserve.prefill.chunks": result.num_chunks, "distserve.prefill.cached_tokens": result.num_cached_tokens})
        self._metrics.queue_time.observe(result.queue_s)
        self._metrics.prefill_time.observe(result.prefill_s)
        self._metrics.prompt_tokens.inc(num_tokens)
        self._metrics.batch_tokens.observe(result.batch_tokens)
        log.info("prefill request_id=%s tokens=%d cached=%d batch=%d queue_s=%.4f prefill_s=%.4f", rid, num_tokens,
                 result.num_cached_tokens, result.batch_size, result.queue_s, result.prefill_s)

    def _record_finish(self, seq: Sequence) -> None:
        rid, finish = seq.request_id, seq.finish_reason
        tracing.record_span("generate", rid, tracing.wall_ns(seq.started_at), tracing.wall_ns(seq.finished_at),
                            **{"gen_ai.usage.output_tokens": seq.num_generated,
                               "gen_ai.response.finish_reasons": [finish.value],
                               "distserve.decode.mean_batch_size": round(seq.mean_batch_size, 2)})
        self._metrics.decode_time.observe(seq.finished_at - seq.started_at)
        self._metrics.success.labels(finished_reason=finish.value).inc()
        log.info("decode request_id=%s tokens=%d reason=%s decode_s=%.4f", rid, seq.num_generated, finish.value,
                 seq.finished_at - seq.started_at)

    async def GetColocatedStats(self, request, context):
        usage = self._engine.decode.usage()
        return colocated_pb2.GetColocatedStatsResponse(
            worker_id=self._config.resolved_worker_id,
            num_used_blocks=usage.num_used_blocks, num_total_blocks=usage.num_blocks,
            num_running=usage.num_running, num_waiting=self._engine.prefill.num_waiting,
            num_steps=self._engine.num_steps, max_running=usage.max_running_seen,
        )
