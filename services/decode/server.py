"""The decode gRPC servicer: claim the handle, reserve blocks, pull KV, stream tokens."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
import torch

from distserve import tracing
from distserve.broker_client import BrokerClient
from distserve.convert import finish_to_proto, logprobs_to_proto, sampling_from_proto
from distserve.request_types import completion_params
from distserve.engine.dtype import torch_dtype
from distserve.model_spec import ModelSpec
from distserve.mux import MuxServer
from distserve.metrics import DecodeMetrics
from distserve.transfer.checksum import ChunkChecksums
from distserve.transfer.connector import KvConsumer, TransferError
from distserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc, kvbroker_pb2
from services.decode.config import DecodeConfig
from distserve.engine.decode_engine import DecodeEngine, NoCapacity
from distserve.engine.decode_scheduler import Preempted
from distserve.engine.sequence import Sequence, stream_outputs

log = logging.getLogger(__name__)


def request_error(request, spec: ModelSpec) -> str | None:
    if not request.kv_handle_id:
        return "kv_handle_id: required"
    if not request.prompt_token_ids:
        return "prompt_token_ids: must not be empty"
    if not 0 <= request.first_token_id < spec.vocab_size:
        return f"first_token_id: {request.first_token_id} is outside the vocabulary"
    if request.sampling.HasField("max_tokens") and request.sampling.max_tokens <= 0:
        return "sampling.max_tokens: must be > 0"
    if request.starts and request.starts[0].token_id != request.first_token_id:
        return "starts: the first one must be first_token_id"
    if len(request.starts) > 1 and len(request.output_token_ids) > 1:
        return "starts: a migrated request (output_token_ids set) continues one completion"
    if any(not 0 <= s.token_id < spec.vocab_size for s in request.starts):
        return "starts: a token id is outside the vocabulary"
    outputs = request.output_token_ids
    if outputs and outputs[-1] != request.first_token_id:
        return "output_token_ids: the last one must be first_token_id"
    if any(not 0 <= t < spec.vocab_size for t in outputs):
        return "output_token_ids: a token id is outside the vocabulary"
    if outputs and request.sampling.HasField("max_tokens") and len(outputs) >= request.sampling.max_tokens:
        return f"output_token_ids: {len(outputs)} tokens already reach sampling.max_tokens"
    return None


async def merged(streams):
    """Several async iterators as one: (which, item) as items arrive; an error in one raises here
    (the others are cancelled)."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(which: int, stream) -> None:
        try:
            async for item in stream:
                await queue.put((which, item))
            await queue.put((which, done))
        except BaseException as exc:  # noqa: BLE001 - handed to the reader, which raises it
            await queue.put((which, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            which, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield which, item
    finally:
        for task in tasks:
            task.cancel()


async def _tagged(stream):
    async for item in stream:
        yield 0, item


def _sequences(request, params) -> tuple[list[Sequence], list[int]]:
    """The sequences to decode and their completion indexes: one per unfinished start of an n > 1
    request (completion i seeded as completion_params says), else the one completion so far."""
    prompt = list(request.prompt_token_ids)
    if len(request.starts) <= 1:
        return [Sequence(request.request_id, prompt + completion_so_far(request), len(prompt), params, [],
                         asyncio.Queue())], [0]
    starts = [(i, s) for i, s in enumerate(request.starts) if s.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED]
    return ([Sequence(request.request_id, prompt + [s.token_id], len(prompt), completion_params(params, i), [],
                      asyncio.Queue()) for i, s in starts], [i for i, _ in starts])


def completion_so_far(request) -> list[int]:
    """The completion tokens the request arrives with: all of them for a migrated request, else the
    first token alone. The KV to pull covers the prompt and all of these but the last."""
    return list(request.output_token_ids) or [request.first_token_id]


def pull_start(handle: kvbroker_pb2.KvHandle, shared_tokens: int) -> tuple[int, int | ChunkChecksums]:
    """(the first token to pull, what the pulled bytes must match) for a prompt whose first shared_tokens
    tokens are here already: the last checksum chunk boundary at or before them (at least one chunk is
    pulled: the sender acknowledges a pull, never an empty one), verified by the handle's chunk checksums;
    from 0 with the whole buffer's CRC32C when nothing is shared or the handle has no chunk checksums."""
    chunk, num_tokens = handle.kv_chunk_tokens, handle.layout.num_tokens
    if not shared_tokens or chunk <= 0 or len(handle.kv_chunk_crc32c) != -(-num_tokens // chunk):
        return 0, handle.kv_crc32c
    from_token = min(shared_tokens, num_tokens - 1) // chunk * chunk
    if from_token == 0:
        return 0, handle.kv_crc32c
    return from_token, ChunkChecksums(chunk, tuple(handle.kv_chunk_crc32c))


def layout_error(layout: common_pb2.KvLayout, spec: ModelSpec, dtype: str, prompt_len: int) -> str | None:
    expected = (spec.num_layers, spec.num_kv_heads, spec.head_dim, dtype, prompt_len)
    got = (layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.dtype, layout.num_tokens)
    return None if expected == got else f"KV layout {got} does not match this worker {expected}"


class DecodeServicer(decode_pb2_grpc.DecodeServiceServicer):
    def __init__(self, config: DecodeConfig, spec: ModelSpec, engine: DecodeEngine, receiver: KvConsumer,
                 broker: BrokerClient, metrics: DecodeMetrics):
        self._config = config
        self._spec = spec
        self._engine = engine
        self._receiver = receiver
        self._broker = broker
        self._metrics = metrics
        # DecodeMux: Decode calls over one stream per router, an engine step's tokens for all of that
        # router's requests in one message; drain_sessions is the server's on_stop.
        self.DecodeMux, self.drain_sessions = MuxServer.methods(self.Decode, decode_pb2.DecodeRequest)

    async def Decode(self, request, context):
        rid = request.request_id
        with tracing.server_context(context), tracing.span("decode", rid, **{
                "gen_ai.operation.name": "text_completion", "distserve.worker": self._config.resolved_worker_id,
                "gen_ai.request.max_tokens": request.sampling.max_tokens}):
            async for response in self._decode(request, context):
                yield response

    async def _decode(self, request, context):
        """One completion, or n of one prompt (request.starts): the KV is pulled once into the first
        sequence's blocks and the others fork from it (shared full blocks, own copy of the partial one).
        Streams every completion's tokens, each message tagged with its index."""
        error = request_error(request, self._spec)
        if error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, error)
        rid, prompt = request.request_id, list(request.prompt_token_ids)
        seqs, indexes = _sequences(request, sampling_from_proto(request.sampling))
        for seq in seqs:
            seq.grammar = await self._grammar_state(seq.params, seq.tokens[len(prompt):], context)
        first, in_engine, owns_handle = seqs[0], False, False
        try:
            with tracing.span("kv_load", rid, **{"distserve.kv.handle_id": request.kv_handle_id,
                                                 "distserve.completions": len(seqs)}):
                # Blocks first: once claimed, the KV is pulled at once, well within the owner's lease. Full
                # blocks here that hold the prompt's first tokens are taken before reserving the rest, so the
                # reservation never evicts them. A request arriving with decoded tokens was moved here (maybe
                # preempted), and n completions share blocks: both reserve their whole life, so neither can be
                # preempted (again).
                shared = self._engine.share_cached_prefix(first, first.context_len)
                first.block_table += await self._reserve_blocks(
                    first.context_len, first.params.max_tokens - first.num_generated + 1,
                    len(request.output_token_ids) > 1 or len(request.starts) > 1, context,
                    held_blocks=len(first.block_table))
                for seq in seqs[1:]:
                    seq.block_table = await self._reserve_exact(
                        self._engine.fork_blocks(len(prompt), seq.params.max_tokens), context)
                handle = await self._claim(request, context)
                owns_handle = True
                transfer_s = await self._load_kv(handle, first, request.kv_secret, context, shared)
                for seq in seqs[1:]:
                    self._engine.fork(first, len(prompt), seq)
            release = self._broker.release_soon(request.kv_handle_id, "received", rid)
            owns_handle = False
            for seq in seqs:
                seq.loaded_at = time.monotonic()
                self._engine.add(seq)
            in_engine = True
            with tracing.span("stream", rid):
                try:
                    async for which, response in self._streams(seqs, transfer_s):
                        response.index = indexes[which]
                        yield response
                except Preempted as exc:
                    # ABORTED: the router moves the request, with its tokens so far, to another worker
                    log.warning("preempted request_id=%s: %s", rid, exc)
                    await context.abort(grpc.StatusCode.ABORTED, str(exc))
            for seq in seqs:
                self._record_finish(seq, seq.finish_reason)
            # Long done as a rule; keeps the broker's span inside this one. Bounded: with the broker down
            # the release goes on retrying in the background, and the stream ends without it.
            await asyncio.wait([release], timeout=self._config.rpc_timeout_s)
        finally:
            if owns_handle:  # claimed here but not received: nobody else will pull it
                self._broker.release_soon(request.kv_handle_id, "cancelled", rid)
            for seq in seqs:
                if in_engine:
                    if seq.finish_reason is None:
                        self._engine.abort(seq)
                else:
                    self._engine.release(seq)

    def _streams(self, seqs: list[Sequence], transfer_s: float):
        """(which sequence, message) as they come; one sequence is streamed without merging's task hop."""
        if len(seqs) > 1:
            return merged(self._stream(seq, transfer_s) for seq in seqs)
        return _tagged(self._stream(seqs[0], transfer_s))

    async def _grammar_state(self, params, completion: list[int], context):
        """A constrained sequence's grammar state past its completion so far (None: unconstrained)."""
        if params.structured is None:
            return None
        from distserve.engine.structured import InvalidGrammar, TokenRejected
        try:
            return await asyncio.to_thread(self._engine.grammars.matcher, params.structured, completion)
        except (InvalidGrammar, TokenRejected) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"sampling.structured_output: {exc}")

    async def _reserve_exact(self, num_blocks: int, context) -> list[int]:
        try:
            return await asyncio.wait_for(self._engine.reserve(num_blocks), self._config.admission_timeout_s)
        except asyncio.TimeoutError:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"no {num_blocks} free KV blocks in time")

    async def _claim(self, request, context) -> kvbroker_pb2.KvHandle:
        try:
            handle = await self._broker.claim(request.kv_handle_id, self._config.resolved_worker_id,
                                              request.request_id)
        except grpc.aio.AioRpcError as exc:
            # Never UNAVAILABLE: to the router that means "this decode worker is unreachable". DATA_LOSS:
            # the handle's record failed its signature check at the broker (forged or rewritten in Redis):
            # refused like a handle without a checksum, and nothing is pulled.
            code = exc.code() if exc.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION,
                                                grpc.StatusCode.DATA_LOSS) else grpc.StatusCode.ABORTED
            await context.abort(code, f"claim of kv_handle_id {request.kv_handle_id} failed: {exc.details()}")
        kv_tokens = len(request.prompt_token_ids) + len(completion_so_far(request)) - 1
        error = layout_error(handle.layout, self._spec, self._config.dtype, kv_tokens)
        if error:
            self._broker.release_soon(request.kv_handle_id, "layout mismatch", request.request_id)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, error)
        return handle

    async def _reserve_blocks(self, prompt_len: int, max_tokens: int, whole_life: bool, context,
                              held_blocks: int = 0) -> list[int]:
        try:
            return await self._engine.reserve_for(prompt_len, max_tokens, self._config.admission_timeout_s,
                                                 self._config.max_waiting_for_blocks, whole_life, held_blocks)
        except NoCapacity as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))

    async def _load_kv(self, handle: kvbroker_pb2.KvHandle, seq: Sequence, secret: str, context,
                       shared: int) -> float:
        """Pulls the handle's KV, presenting the request's secret, verifies its checksums (a mismatch is
        pulled once more, then DATA_LOSS "checksum") and writes it into the sequence's blocks. When the
        sequence's first `shared` tokens are in blocks here already (share_cached_prefix), only the rest
        is pulled, from a checksum chunk boundary on."""
        layout = handle.layout
        if not handle.HasField("kv_crc32c"):  # every prefill worker sends one: this record was not written by one
            await context.abort(grpc.StatusCode.DATA_LOSS, f"kv handle {handle.handle_id} carries no checksum; "
                                                           "its KV is not loaded")
        from_token, expected = pull_start(handle, shared)
        staging = torch.empty((layout.num_layers, 2, layout.num_tokens - from_token, layout.num_kv_heads,
                               layout.head_dim), dtype=torch_dtype(layout.dtype))
        try:
            transfer_s = await self._receiver.fetch(handle.owner_ucx_address, handle.handle_id, staging,
                                                    self._config.transfer_timeout_s, seq.request_id, secret,
                                                    expected, from_token)
        except TransferError as exc:
            # DATA_LOSS, not UNAVAILABLE (this worker is fine): the KV's owner could not deliver it (gone,
            # stalled, refused, or bytes that failed their checksum); the router prefills again elsewhere
            await context.abort(grpc.StatusCode.DATA_LOSS, str(exc))
        num_bytes = staging.numel() * staging.element_size()
        self._metrics.kv_transfer_time.observe(transfer_s)
        self._metrics.kv_transfer_bytes.inc(num_bytes)
        self._engine.load_prompt(seq, staging, kv_start=from_token, shared_tokens=shared)
        log.info("kv_load request_id=%s handle=%s bytes=%d of %d seconds=%.4f gbps=%.3f", seq.request_id,
                 handle.handle_id, num_bytes, layout.num_bytes, transfer_s, num_bytes / max(transfer_s, 1e-9) / 1e9)
        return transfer_s

    async def _stream(self, seq: Sequence, transfer_s: float):
        async for token_ids, finish, logprobs in stream_outputs(seq):
            response = decode_pb2.DecodeResponse(token_ids=token_ids, finish_reason=finish_to_proto(finish),
                                                 logprobs=[logprobs_to_proto(e) for e in logprobs])
            self._metrics.generation_tokens.inc(len(token_ids))
            if finish is not None:
                response.timings.CopyFrom(common_pb2.Timings(
                    transfer_s=transfer_s, decode_queue_s=seq.started_at - seq.loaded_at,
                    decode_s=seq.finished_at - seq.started_at))
            yield response

    def _record_finish(self, seq: Sequence, finish) -> None:
        rid = seq.request_id
        tracing.record_span("queue", rid, tracing.wall_ns(seq.loaded_at), tracing.wall_ns(seq.started_at))
        tracing.record_span("generate", rid, tracing.wall_ns(seq.started_at), tracing.wall_ns(seq.finished_at),
                            **{"gen_ai.usage.output_tokens": seq.num_generated,
                               "gen_ai.response.finish_reasons": [finish.value],
                               "distserve.decode.mean_batch_size": round(seq.mean_batch_size, 2)})
        self._metrics.queue_time.observe(seq.started_at - seq.loaded_at)
        self._metrics.decode_time.observe(seq.finished_at - seq.started_at)
        self._metrics.success.labels(finished_reason=finish.value).inc()
        log.info("decode request_id=%s tokens=%d reason=%s decode_s=%.4f", rid, seq.num_generated, finish.value,
                 seq.finished_at - seq.started_at)

    async def GetDecodeStats(self, request, context):
        usage = self._engine.usage()
        return decode_pb2.GetDecodeStatsResponse(
            worker_id=self._config.resolved_worker_id,
            kv_bytes_received=self._receiver.counters.num_bytes,
            kv_transfers_received=self._receiver.counters.num_transfers,
            num_used_blocks=usage.num_used_blocks, num_total_blocks=usage.num_blocks,
            num_running=usage.num_running, num_waiting=usage.num_waiting, max_running=usage.max_running_seen,
        )
