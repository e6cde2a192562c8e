"""The router's Generate servicer: one request through prefill and decode, streamed."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
import uuid

import grpc
from opentelemetry import trace

from distserve import tracing
from distserve.broker_client import BrokerClient
from distserve.convert import finish_from_proto, sampling_to_proto
from distserve.model_spec import ModelSpec
from distserve.request_types import SamplingParams
from distserve.grpc_server import ChannelPool
from distserve.mux import MuxClient, MuxServer, MuxSessions
from distserve.metrics import RouterMetrics
from distserve.registry import WorkerRecord
from distserve.v1 import colocated_pb2, colocated_pb2_grpc, common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc, router_pb2, router_pb2_grpc
from services.router.config import RouterConfig
from services.router.grammar_check import GrammarChecker
from services.router.picker import DECODE_AFFINITY_SLACK, WorkerPicker
from services.router.stage_failure import StageFailed
from services.router import tokenizer_service
from services.router.read_watchdog import ReadWatchdog
from services.router.request_state import Completion, RequestState
from services.router.text_stream import TextStream
from services.router.validation import InvalidRequest, validate_request_async

log = logging.getLogger(__name__)

# Worker errors that describe the request itself are passed to the client as they are.
_PASS_THROUGH = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                 grpc.StatusCode.DEADLINE_EXCEEDED}


def _trace_failure(code: grpc.StatusCode, details: str) -> None:
    """Why the request failed, on its router span (the span's own status only says the call aborted)."""
    trace.get_current_span().set_attributes({"distserve.error.code": code.name, "distserve.error.message": details})


class RouterServicer(router_pb2_grpc.RouterServiceServicer):
    def __init__(self, config: RouterConfig, tokenizer, spec: ModelSpec, picker: WorkerPicker,
                 channels: ChannelPool, grammars: GrammarChecker, model_name: str, metrics: RouterMetrics):
        self._config = config
        self._tokenizer = tokenizer
        self._spec = spec
        self._picker = picker
        self._channels = channels
        self._model_name = model_name
        self._key_space = (config.model, config.prefix_seed)  # the workers' prefix keys (PromptBlocks)
        self._metrics = metrics
        self._broker = BrokerClient.over(channels, config.broker_address, config.rpc_timeout_s)
        self._grammars = grammars
        # one multiplexed session per worker carries all of this router's streams to it (distserve.mux)
        self._decode_sessions = MuxSessions(lambda channel: decode_pb2_grpc.DecodeServiceStub(channel).DecodeMux,
                                            decode_pb2.DecodeResponse)
        self._colocated_sessions = MuxSessions(
            lambda channel: colocated_pb2_grpc.ColocatedServiceStub(channel).PrefillAndDecodeMux,
            colocated_pb2.PrefillAndDecodeResponse)
        # GenerateMux: Generate calls over one stream per gateway; drain_sessions is the server's on_stop.
        self.GenerateMux, self.drain_sessions = MuxServer.methods(self.Generate, router_pb2.GenerateRequest)

    async def Generate(self, request, context):
        request_id = request.request_id or uuid.uuid4().hex
        self._metrics.running.inc()
        try:
            with tracing.server_context(context), tracing.span(
                    "router.generate", request_id, **{"gen_ai.operation.name": "text_completion",
                                                      "gen_ai.request.model": self._model_name}):
                req = await self._accept(request, request_id, context)
                # a resumed request continues as a migrated one does, on a prefill/decode pair
                colocated = None if req.outputs else await self._route_colocated(req, context)
                if colocated is not None:
                    messages = self._run_colocated(req, colocated, context)
                else:
                    prefill_worker, decode_worker = await self._route(req, context)
                    messages = self._run(req, prefill_worker, decode_worker, context)
                async for message in messages:
                    for released in req.released(message):
                        yield released
        finally:
            self._metrics.running.dec()

    async def _accept(self, request, request_id: str, context) -> RequestState:
        try:
            prompt, params = await validate_request_async(request, self._tokenizer, self._spec)
        except InvalidRequest as exc:
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if params.structured is not None:
            await self._check_grammar(params, context)
        if not params.is_greedy and params.seed is None:
            params = dataclasses.replace(params, seed=secrets.randbits(63))  # reproducible from the trace
        trace.get_current_span().set_attributes({
            "gen_ai.request.max_tokens": params.max_tokens, "gen_ai.request.temperature": params.temperature,
            "gen_ai.request.top_p": params.top_p, "gen_ai.request.seed": params.seed or 0,
            "gen_ai.usage.input_tokens": len(prompt), **({"user.id": request.user} if request.user else {})})
        self._metrics.prompt_tokens.inc(len(prompt))
        num_returned = max(request.n, 1)
        num_generated = max(request.best_of, num_returned)
        strip_logprobs = num_generated > num_returned and params.logprobs is None
        if strip_logprobs:
            params = dataclasses.replace(params, logprobs=0)  # best_of ranks by cumulative logprob
        completions = [Completion(TextStream(self._tokenizer, params.stop)) for _ in range(num_generated)]
        req = RequestState(request_id, prompt, params, completions, time.monotonic(), self._metrics,
                           num_returned=num_returned, strip_logprobs=strip_logprobs)
        if request.echo:
            req.echo_text = (request.text if request.WhichOneof("prompt") == "text"
                             else self._tokenizer.decode(prompt))
        if request.resume_token_ids:
            req.resume(list(request.resume_token_ids))
            trace.get_current_span().set_attribute("distserve.resumed_tokens", len(request.resume_token_ids))
        return req

    async def _check_grammar(self, params: SamplingParams, context) -> None:
        """INVALID_ARGUMENT when the request's grammar does not compile within the deadline (verdicts
        cached); UNAVAILABLE when the compiler process cannot start."""
        try:
            problem = await self._grammars.problem(params.structured)
        except RuntimeError as exc:
            await self._refuse(context, grpc.StatusCode.UNAVAILABLE, f"structured_output: {exc}")
        if problem:
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, f"structured_output: {problem}")

    def _kv_tokens(self, req: RequestState) -> int:
        """Tokens of KV the request may need: prompt + max_tokens, capped at the context."""
        return min(len(req.prompt) + req.params.max_tokens, self._spec.max_context)

    async def _route_colocated(self, req: RequestState, context) -> WorkerRecord | None:
        """The colocated worker to send the whole request to, or None for the prefill/decode path:
        a spill-only one while the pairs are saturated, else a dedicated one with fewer outstanding
        prompt tokens than the pairs' prefill (see services.router.picker)."""
        if not self._picker.workers("colocated"):
            return None
        if len(req.completions) > 1:
            if self._picker.workers("decode"):
                return None  # n > 1 shares one prompt's KV on a decode worker
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT,
                               "n: colocated workers serve one completion per request (n = 1, no best_of)")
        num_tokens, blocks = self._kv_tokens(req), req.prompt_blocks(*self._key_space)
        follow_up = self._picker.pick_prefix_spill(len(req.prompt), num_tokens, blocks)
        if follow_up is not None:
            half, held = follow_up
            return self._routed_colocated(req, half, f"its decode worker holds {held} of the prompt's tokens "
                                          "(a chat's last turn and answer)", expected_cached=held)
        spill = self._picker.pick_spill(len(req.prompt), num_tokens, blocks)
        if spill is not None:
            await self._picker.announce_spill()
            return self._routed_colocated(req, spill, "pairs saturated; expected to be free first")
        colocated = self._picker.pick_colocated(num_tokens, blocks)
        # no room check for this prompt here (0 tokens): a full prefill worker is refused by _route, by name
        prefill = self._picker.pick_prefill(0, blocks) if self._picker.workers("decode") else None
        if colocated is None and prefill is None:
            await self._refuse(context, grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"prompt + max_tokens need KV for {num_tokens} tokens; no colocated worker has "
                               "that much KV cache")
        if not self._picker.prefers_colocated(colocated, prefill, blocks):
            return None
        return self._routed_colocated(req, colocated, "fewest outstanding prompt tokens "
                                      f"({colocated.load.get('outstanding_tokens', 0)} reported)")

    def _routed_colocated(self, req: RequestState, colocated: WorkerRecord, reason: str,
                          expected_cached: int | None = None) -> WorkerRecord:
        """Records the colocated route (span, log and prefix index) and returns its worker; expected_cached:
        the prompt tokens it is known to hold, where the prefix index of prefill caches does not know."""
        with tracing.span("route", req.request_id) as span:
            req.expected_cached_tokens = self._expect_cached(req, colocated)
            if expected_cached is not None:
                req.expected_cached_tokens = expected_cached
            span.set_attributes({"distserve.colocated.worker": colocated.worker_id,
                                 "distserve.colocated.expected_cached_tokens": req.expected_cached_tokens,
                                 "distserve.colocated.reason": reason,
                                 "distserve.colocated.spill": bool(colocated.load.get("spill_only")),
                                 "distserve.colocated.candidates": len(self._picker.workers("colocated"))})
        log.info("route request_id=%s colocated=%s%s prompt_tokens=%d expected_cached=%d", req.request_id,
                 colocated.worker_id, " (spill)" if colocated.load.get("spill_only") else "", len(req.prompt),
                 req.expected_cached_tokens)
        return colocated

    async def _run_colocated(self, req: RequestState, worker: WorkerRecord, context):
        """Streams the whole request from one colocated worker. If the worker fails in a way another
        can make up for, and prefill/decode pairs are registered, the request moves to a pair: the
        prompt plus the completion so far is prefilled again and decoding continues there (request
        migration, as in `_run`); the client sees one stream."""
        try:
            async for message in self._colocated_attempt(req, worker):
                yield message
            if len(req.completions) == 1:  # its blocks stay cached there: the next turn's prefix
                self._picker.remember_conversation(worker, req.answered_blocks(*self._key_space))
            return
        except StageFailed as failure:
            if not self._picker.workers("decode"):
                await self._abort_for(failure, context)  # colocated-only fleet: nowhere to resume
            prefill_worker, decode_worker = await self._replace_workers(req, failure, context)
        async for message in self._run(req, prefill_worker, decode_worker, context):
            yield message

    async def _colocated_attempt(self, req: RequestState, worker: WorkerRecord):
        """One PrefillAndDecode call; raises StageFailed if the worker fails."""
        channel = self._channels.get(worker.address)
        request = colocated_pb2.PrefillAndDecodeRequest(
            request_id=req.request_id, prompt_token_ids=req.prompt, sampling=sampling_to_proto(req.params))
        if self._config.decode_mux and MuxClient.fits(request):
            call = self._colocated_sessions.client(worker.address, channel).call(
                request, tracing.inject_headers({}), timeout=self._config.request_timeout_s)
        else:
            call = colocated_pb2_grpc.ColocatedServiceStub(channel).PrefillAndDecode(
                request, timeout=self._config.request_timeout_s)
        try:
            # a stream in the worker's one decode batch (a decode worker's spilled requests share it)
            with self._picker.track_stream(worker), self._picker.track_decode(worker, req.params.max_tokens):
                async for message in self._colocated_messages(req, worker, call):
                    yield message
        except grpc.aio.AioRpcError as exc:
            raise StageFailed.of(exc, worker, "colocated") from exc
        finally:
            call.cancel()

    async def _colocated_messages(self, req: RequestState, worker: WorkerRecord, call):
        """The colocated call's responses as the request's messages, to its last."""
        timings = req.timings
        # until the first token: the prompt's tokens in flight, less those the worker is expected to have cached
        with self._picker.track_prompt(worker, len(req.prompt) - req.expected_cached_tokens):
            response = await call.read()
        while response is not grpc.aio.EOF:
            finish = finish_from_proto(response.finish_reason)
            is_first = not timings.first_token_s
            if is_first or finish is not None:
                timings.MergeFrom(response.timings)
            if is_first:
                timings.first_token_s = time.monotonic() - req.started
                self._metrics.ttft.observe(timings.first_token_s)
                req.num_cached_tokens = min(response.num_cached_tokens, len(req.prompt))
            message = req.chunk(list(response.token_ids), finish, response.logprobs)
            if is_first:
                message.prefill_worker = message.decode_worker = worker.worker_id
                req.add_prompt_fields(message, response.prompt_logprobs)
            if message.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                yield message
                if finish is not None:
                    await call.read()  # the stream's end; keeps the worker's spans inside this request's
                return
            yield message
            response = await call.read()

    async def _route(self, req: RequestState, context) -> tuple[WorkerRecord, WorkerRecord]:
        with tracing.span("route", req.request_id) as span:
            num_tokens = self._kv_tokens(req)
            prefill_worker = self._picker.pick_prefill(len(req.prompt) + len(req.outputs),
                                                       req.prompt_blocks(*self._key_space))
            decode_worker = prefill_worker and self._picker.pick_decode(
                num_tokens, prefill_worker.kv_format, req.failed_decode_workers,
                req.prompt_blocks(*self._key_space) if len(req.completions) == 1 else None)
            for role in ("prefill", "decode"):
                if not self._picker.workers(role):
                    await self._refuse(context, grpc.StatusCode.UNAVAILABLE, f"no {role} worker is registered")
            if prefill_worker is None:
                await self._refuse(context, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                   "every prefill worker is at capacity (prompt queue or held KV); retry later")
            if decode_worker is None:
                await self._refuse(context, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                   f"prompt + max_tokens need KV for {num_tokens} tokens; no decode worker taking "
                                   f"{prefill_worker.kv_format or 'this'} KV has that much KV cache free or "
                                   "room to wait for it")
            req.expected_cached_tokens = self._expect_cached(req, prefill_worker)
            decode_cached = self._picker.decode_cached_tokens(decode_worker, req.prompt_blocks(*self._key_space))
            self._picker.remember_decoded(decode_worker, req.prompt_blocks(*self._key_space))
            span.set_attributes({
                "distserve.prefill.worker": prefill_worker.worker_id,
                "distserve.prefill.reason": "least outstanding prompt tokens plus this prompt's uncached ones "
                                            f"({prefill_worker.load.get('outstanding_tokens', 0)} reported, "
                                            f"{req.expected_cached_tokens} expected cached)",
                "distserve.prefill.expected_cached_tokens": req.expected_cached_tokens,
                "distserve.decode.worker": decode_worker.worker_id,
                "distserve.decode.reason": "room now, then the prompt's blocks held within "
                                           f"{DECODE_AFFINITY_SLACK} running sequence of the least loaded, then "
                                           "fewest running sequences, then most free blocks "
                                           f"({decode_worker.load.get('num_running', 0)} running, "
                                           f"{decode_worker.load.get('free_blocks', 0)} free blocks)",
                "distserve.decode.expected_cached_tokens": decode_cached,
                "distserve.prefill.candidates": len(self._picker.workers("prefill")),
                "distserve.decode.candidates": len(self._picker.workers("decode"))})
        log.info("route request_id=%s prefill=%s decode=%s prompt_tokens=%d expected_cached=%d "
                 "decode_expected_cached=%d", req.request_id, prefill_worker.worker_id, decode_worker.worker_id,
                 len(req.prompt), req.expected_cached_tokens, decode_cached)
        return prefill_worker, decode_worker

    def _expect_cached(self, req: RequestState, worker: WorkerRecord) -> int:
        """The prompt's tokens `worker` is expected to have cached; records that it will hold them all."""
        blocks = req.prompt_blocks(*self._key_space)
        cached = self._picker.cached_tokens(worker, blocks)
        self._picker.remember(worker, blocks)
        return cached

    async def _run(self, req: RequestState, prefill_worker: WorkerRecord, decode_worker: WorkerRecord, context):
        """Prefill, then decode, streaming. A worker lost on the way, or KV that cannot be pulled, is
        replaced: the prompt plus the completion so far is prefilled again on a live prefill worker
        and decoding continues on a live decode worker (request migration), at most max_retries times.
        The client sees one stream: nothing already sent is sent again."""
        handle_id, handed_off = "", False
        try:
            while True:
                # The router names the KV handle, so it can release it whatever happens to the prefill call.
                handle_id, secret = uuid.uuid4().hex, secrets.token_hex(16)
                try:
                    with self._picker.track_stream(decode_worker), \
                            self._picker.track_decode(decode_worker, req.params.max_tokens * len(req.completions)):
                        async for message in self._attempt(req, prefill_worker, decode_worker, handle_id, secret):
                            yield message
                    handed_off = True
                    if len(req.completions) == 1:  # its blocks stay cached there: the next turn's prefix
                        self._picker.remember_decoded(decode_worker, req.answered_blocks(*self._key_space))
                    return
                except StageFailed as failure:
                    self._broker.release_soon(handle_id, "retried", req.request_id)
                    if failure.stage == "decode" and failure.code == grpc.StatusCode.DATA_LOSS:
                        self._picker.mark_suspect(prefill_worker)  # it could not deliver its KV: stalled or gone
                    prefill_worker, decode_worker = await self._replace_workers(req, failure, context)
        finally:
            if not handed_off and handle_id:
                # cancelled, failed, or never handed to decode: free the KV (releasing twice is harmless)
                self._broker.release_soon(handle_id, "cancelled", req.request_id)

    async def _attempt(self, req: RequestState, prefill_worker: WorkerRecord, decode_worker: WorkerRecord,
                       handle_id: str, secret: str):
        """One try at the rest of the request. Raises StageFailed if a worker failed in a way another
        worker can make up for; the request's own errors abort the call."""
        call = None
        try:
            # In flight from the pick on, connecting included: requests picked meanwhile see it.
            with self._picker.track_prompt(prefill_worker,
                                           len(req.prompt) + len(req.outputs) - req.expected_cached_tokens):
                call = await self._prefill(req, prefill_worker, handle_id, secret)
                first = await self._prefill_part(call, prefill_worker)
            if first is grpc.aio.EOF:
                raise StageFailed(grpc.StatusCode.INTERNAL, "prefill stream ended without its first token",
                                  prefill_worker, "prefill")
            if not req.outputs:  # the first token goes out while the prefill worker registers the KV
                for message in self._first_messages(req, first, prefill_worker, decode_worker):
                    yield message
            await self._merge_kv_part(req, call, first, prefill_worker)
        finally:
            if call is not None:
                call.cancel()
        if req.all_finished:
            if first.kv_handle_id:  # a stop string on the first token leaves KV held
                self._broker.release_soon(handle_id, "finished", req.request_id)
            return
        moved = bool(req.outputs)  # a migrated request: its first message now names the new workers
        async for message in self._decode(req, first, decode_worker, secret):
            if moved:
                message.prefill_worker, message.decode_worker = prefill_worker.worker_id, decode_worker.worker_id
                moved = False
            yield message

    def _first_messages(self, req: RequestState, first, prefill_worker: WorkerRecord,
                        decode_worker: WorkerRecord) -> list[router_pb2.GenerateResponse]:
        """A message per completion with its first token; the first one carries the request's extras."""
        req.timings.MergeFrom(first.timings)
        req.timings.first_token_s = time.monotonic() - req.started
        req.num_cached_tokens = min(first.num_cached_tokens, len(req.prompt))
        self._metrics.ttft.observe(req.timings.first_token_s)
        tracing.mark(tracing.FIRST_TOKEN_SENT, req.request_id)  # the worker registers the KV after: not TTFT
        starts = first.starts or [common_pb2.CompletionStart(
            token_id=first.first_token_id, finish_reason=first.finish_reason,
            logprobs=first.first_token_logprobs if first.HasField("first_token_logprobs") else None)]
        messages = []
        for index, start in enumerate(starts):
            logprobs = [start.logprobs] if start.HasField("logprobs") else []
            messages.append(req.chunk([start.token_id], finish_from_proto(start.finish_reason), logprobs,
                                        index))
        messages[0].prefill_worker, messages[0].decode_worker = prefill_worker.worker_id, decode_worker.worker_id
        req.add_prompt_fields(messages[0], first.prompt_logprobs)
        return messages

    async def _replace_workers(self, req: RequestState, failure: "StageFailed",
                               context) -> tuple[WorkerRecord, WorkerRecord]:
        """New workers for a request whose `failure.stage` failed; aborts the call when the failure is
        not one another worker can make up for, or the request is out of retries."""
        worker = failure.worker
        midway_many = len(req.completions) > 1 and any(c.outputs for c in req.completions)
        if not failure.retryable or req.num_retries >= self._config.max_retries or midway_many:
            await self._abort_for(failure, context)  # (n > 1 requests are retried only before any token)
        if failure.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            self._picker.mark_suspect(worker)
        if failure.stage == "decode":  # the retry decodes elsewhere when it can (e.g. the link is what failed)
            req.failed_decode_workers.add(worker.worker_id)
        req.num_retries += 1
        self._metrics.retries.labels(stage=failure.stage).inc()
        with tracing.span("retry", req.request_id) as span:
            span.set_attributes({"distserve.retry.number": req.num_retries, "distserve.retry.stage": failure.stage,
                                 "distserve.retry.failed_worker": worker.worker_id,
                                 "distserve.retry.code": failure.code.name, "distserve.retry.reason": failure.details,
                                 "distserve.retry.completion_tokens": len(req.outputs)})
            log.warning("retry request_id=%s %s worker %s failed (%s: %s); re-prefilling %d+%d tokens",
                        req.request_id, failure.stage, worker.worker_id, failure.code.name, failure.details,
                        len(req.prompt), max(len(req.outputs) - 1, 0))
            return await self._route(req, context)

    async def _connected(self, worker: WorkerRecord, stage: str) -> grpc.aio.Channel:
        """The worker's channel once connected, waiting up to connect_timeout_s. A channel whose last
        connect failed fails its calls at once until its backoff ends, even when the worker is back
        (restarted): waiting for the reconnect here spares a healthy worker being taken for dead.
        Raises StageFailed (UNAVAILABLE) when it does not connect in time."""
        channel = self._channels.get(worker.address)
        if channel.get_state(try_to_connect=True) != grpc.ChannelConnectivity.READY:
            try:
                await asyncio.wait_for(channel.channel_ready(), self._config.connect_timeout_s)
            except asyncio.TimeoutError:
                raise StageFailed(grpc.StatusCode.UNAVAILABLE, f"could not connect to {worker.address} within "
                                   f"{self._config.connect_timeout_s:g}s", worker, stage) from None
        return channel

    async def _prefill(self, req: RequestState, worker: WorkerRecord, handle_id: str, secret: str):
        """The PrefillStream call: the first token, then the registered KV handle (see the proto)."""
        stub = prefill_pb2_grpc.PrefillServiceStub(await self._connected(worker, "prefill"))
        # a migrated request's prompt logprobs were sent already: not computed again
        params = dataclasses.replace(req.params, prompt_logprobs=None) if req.outputs else req.params
        call = prefill_pb2.PrefillRequest(request_id=req.request_id, prompt_token_ids=req.prompt,
                                          sampling=sampling_to_proto(params), kv_handle_id=handle_id,
                                          output_token_ids=req.outputs, kv_secret=secret,
                                          n=len(req.completions))
        return stub.PrefillStream(call, timeout=self._config.prefill_timeout_s)

    async def _prefill_part(self, call, worker: WorkerRecord):
        """The PrefillStream's next part (EOF after the last); raises StageFailed if the worker fails,
        or UNAVAILABLE as soon as its registry lease lapses (hung or paused: no heartbeat for lease_s),
        instead of waiting out prefill_timeout_s or keepalive behind a worker that will not answer."""
        read = asyncio.ensure_future(call.read())
        with self._picker.watch_lapse(worker) as lapsed:
            lapse = asyncio.ensure_future(lapsed.wait())
            try:
                await asyncio.wait((read, lapse), return_when=asyncio.FIRST_COMPLETED)
            finally:
                lapse.cancel()
                if not read.done():
                    read.cancel()
        if not read.done() or read.cancelled():
            raise StageFailed(grpc.StatusCode.UNAVAILABLE, "its registry lease lapsed (no heartbeat) while "
                              "prefilling", worker, "prefill")
        try:
            return read.result()
        except grpc.aio.AioRpcError as exc:
            raise StageFailed.of(exc, worker, "prefill") from exc

    async def _merge_kv_part(self, req: RequestState, call, first, worker: WorkerRecord) -> None:
        """Merges the PrefillStream's KV part (kv_handle_id, kv_layout) into `first`, reading to the
        stream's end, which keeps the worker's spans inside the request's. The worker registers the KV
        before it sends that part, so a failure after it is no prefill failure: decode's pull finds out
        whether the KV can still be had (a retry there, if not). Raises StageFailed before it."""
        try:
            while (kv := await call.read()) is not grpc.aio.EOF:
                first.MergeFrom(kv)
        except grpc.aio.AioRpcError as exc:
            if not first.kv_handle_id:
                raise StageFailed.of(exc, worker, "prefill") from exc
            log.warning("request_id=%s prefill worker %s failed after handing over its KV handle (%s); "
                        "decoding on", req.request_id, worker.worker_id, exc.code().name)

    async def _decode(self, req: RequestState, first, worker: WorkerRecord, secret: str):
        """Streams the decode worker's tokens; raises StageFailed if the worker fails."""
        channel = await self._connected(worker, "decode")
        request = decode_pb2.DecodeRequest(
            request_id=req.request_id, kv_handle_id=first.kv_handle_id, prompt_token_ids=req.prompt,
            first_token_id=first.first_token_id, sampling=sampling_to_proto(req.params),
            output_token_ids=req.outputs, kv_secret=secret, starts=first.starts)
        if self._config.decode_mux and MuxClient.fits(request):
            call = self._decode_sessions.client(worker.address, channel).call(
                request, tracing.inject_headers({}), timeout=self._config.request_timeout_s)
        else:
            call = decode_pb2_grpc.DecodeServiceStub(channel).Decode(request, timeout=self._config.request_timeout_s)
        watchdog = ReadWatchdog(self._config.decode_idle_timeout_s)
        try:
            while (response := await self._next_message(call, watchdog, worker)) is not grpc.aio.EOF:
                if req.completions[response.index].finish is not None:
                    continue  # a stop string ended this completion here; the worker went on with it
                finish = finish_from_proto(response.finish_reason)
                if finish is not None:
                    req.timings.MergeFrom(response.timings)
                message = req.chunk(list(response.token_ids), finish, response.logprobs, response.index)
                yield message
                if req.all_finished:
                    if finish is not None:
                        # the worker's stream ends right after its last message; waiting for that
                        # keeps its spans inside this request's (read(), never `async for`: grpc.aio
                        # refuses mixing the two on one call when no interceptor wraps it)
                        while await call.read() is not grpc.aio.EOF:
                            pass
                    return  # else a stop string ended it first: the finally cancels the worker's call
        except grpc.aio.AioRpcError as exc:
            raise StageFailed.of(exc, worker, "decode") from exc
        finally:
            watchdog.close()
            call.cancel()

    async def _next_message(self, call, watchdog: ReadWatchdog, worker: WorkerRecord):
        """The decode stream's next message (or EOF); a worker silent for decode_idle_timeout_s is
        treated as stalled: DEADLINE_EXCEEDED, which moves the request to another worker."""
        try:
            return await watchdog.read(call)
        except TimeoutError:
            raise StageFailed(grpc.StatusCode.DEADLINE_EXCEEDED,
                               f"no message for {self._config.decode_idle_timeout_s:g}s", worker, "decode") from None

    async def _refuse(self, context, code: grpc.StatusCode, details: str) -> None:
        """Ends the call with `code` before any worker was called."""
        self._metrics.failures.labels(code=code.name).inc()
        _trace_failure(code, details)
        await context.abort(code, details)

    async def _abort_for(self, failure: StageFailed, context) -> None:
        code, worker = failure.code, failure.worker
        if code == grpc.StatusCode.UNAVAILABLE:
            self._picker.mark_suspect(worker)
        if code not in _PASS_THROUGH:
            code = grpc.StatusCode.UNAVAILABLE
        self._metrics.failures.labels(code=code.name).inc()
        details = f"{failure.stage} worker {worker.worker_id}: {failure.details}"
        _trace_failure(code, details)
        await context.abort(code, details)

    async def close(self) -> None:
        await self._decode_sessions.close()
        await self._colocated_sessions.close()

    async def Tokenize(self, request, context):
        """The router's tokenizer on a text, as it tokenizes text prompts; INVALID_ARGUMENT names a bad field."""
        try:
            return await tokenizer_service.tokenize_async(request, self._tokenizer, self._spec)
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    async def Detokenize(self, request, context):
        """The text of token ids; INVALID_ARGUMENT names a bad field (an id outside the vocabulary)."""
        try:
            return await tokenizer_service.detokenize_async(request, self._tokenizer, self._spec)
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
