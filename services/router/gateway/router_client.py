"""The gateway's only peers: its routers (a gRPC channel each) and the worker registry (for /health)."""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
from collections.abc import Awaitable, Callable, Mapping

import grpc
import redis.asyncio as aioredis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from distserve import redis_client
from distserve import tracing
from distserve.bearer_key import call_metadata
from distserve.grpc_server import aio_channel
from distserve.mux import MuxCall, MuxClient
from distserve.registry import WorkerRegistry
from distserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from services.router.gateway.config import GatewayConfig
from services.router.gateway.errors import from_router_error, internal_error

ROUTER_SERVICE = "distserve.v1.RouterService"
log = logging.getLogger(__name__)


class RouterAnswer:
    """One Generate call, read message by message; a failed call raises the client's ApiError.

    A router that fails with UNAVAILABLE (it died, or cannot reach any worker) is replaced. Before any
    message, the request starts again on the next router, when there is another. After some, a
    one-completion request resumes on the next router (or the only one, once it is back: a supervised
    router restarts on its address) from the tokens received (GenerateRequest.resume_token_ids), so the
    client sees one unbroken stream. Each router is tried once, the only one twice.

    `cancel()` must run when the caller stops reading for any reason (finished,
    client gone, error): it is what makes the router cancel the workers.
    """

    def __init__(self, start: Callable[[router_pb2.GenerateRequest, int], grpc.aio.UnaryStreamCall],
                 request: router_pb2.GenerateRequest, params: Mapping[str, str], retry_after_s: int,
                 num_routers: int = 1, ready: Callable[[int], Awaitable[None]] | None = None):
        """start(request, attempt): the call on the attempt's router; ready(attempt): waits (bounded) until
        that router's channel connects, before a retry."""
        self._start, self._request, self._ready = start, request, ready
        self._params = params
        self._retry_after_s = retry_after_s
        self._unfinished = max(request.n, 1)
        self._finished = False
        self._attempt, self._num_routers = 0, num_routers
        self._early_failures = self._resumes = 0  # failures before any message, and resumes mid-stream
        self._resumable = self._unfinished == 1 and request.best_of <= 1
        self._received: list[int] = []  # the completion's tokens so far (one-completion requests)
        self._num_messages = 0
        self._call = start(request, 0)

    async def next(self) -> router_pb2.GenerateResponse | None:
        """The next message; None once every completion's message with a finish reason has been returned."""
        if self._finished:
            return None
        while True:
            try:
                message = await self._call.read()
                break
            except grpc.aio.AioRpcError as exc:
                if not self._may_resume(exc):
                    raise from_router_error(exc.code(), exc.details(), self._params, self._retry_after_s) from None
                await self._resume(exc)
        if message is grpc.aio.EOF:
            raise internal_error("the router ended the stream without a finish reason")
        self._num_messages += 1
        if self._resumable:
            self._received += message.token_ids
        if message.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
            self._unfinished -= 1
            self._finished = self._unfinished <= 0
        return message

    def _may_resume(self, error: grpc.aio.AioRpcError) -> bool:
        """Before any message, each other router is tried once (one router that failed before answering:
        its error stands); mid-stream, a one-completion request resumes up to max(1, routers - 1) times.
        The budgets are separate: a router still reconnecting after a restart (its channel fails calls at
        once for up to its 2 s backoff) must not use up the resume of a stream cut later."""
        if error.code() != grpc.StatusCode.UNAVAILABLE:
            return False
        if not self._num_messages:
            self._early_failures += 1
            return self._early_failures < self._num_routers
        self._resumes += 1
        return self._resumable and self._resumes < max(2, self._num_routers)

    async def _resume(self, error: grpc.aio.AioRpcError) -> None:
        self._attempt += 1
        request = router_pb2.GenerateRequest()
        request.CopyFrom(self._request)
        if self._received:
            request.resume_token_ids[:] = self._received
            request.echo = False  # the prompt went out with the first message
        log.warning("request_id=%s: its router failed (%s: %s) after %d tokens; resuming on the next router",
                    request.request_id, error.code().name, error.details(), len(self._received))
        if self._ready is not None and self._received:  # mid-stream: give a restarting router a moment
            await self._ready(self._attempt)
        self._call = self._start(request, self._attempt)

    def cancel(self) -> None:
        """Idempotent; a no-op once the call has completed."""
        self._call.cancel()

    async def close(self, end_wait_s: float = 2.0) -> None:
        """Ends the call: a finished answer is let end by itself (the router then completes its own
        clean-up and trace spans instead of being cancelled); anything else is cancelled."""
        if self._finished:
            try:
                await asyncio.wait_for(self._call.code(), end_wait_s)
                return
            except (asyncio.TimeoutError, grpc.aio.AioRpcError):
                pass
        self._call.cancel()


class RouterClient:
    """Owns the router channel and the registry's Redis client; open in the app's startup, close() at cleanup."""

    def __init__(self, config: GatewayConfig):
        self._config = config
        self._addresses = config.router_addresses
        self._channels = [aio_channel(a, config, tracing.client_interceptors()) for a in self._addresses]
        self._stubs = [router_pb2_grpc.RouterServiceStub(channel) for channel in self._channels]
        self._next_router = itertools.count()  # requests go round the routers
        self._metadata = call_metadata(config.api_key)  # the router wants the deployment's key too
        # One multiplexed session per router carries every request's stream (distserve.mux); its call's
        # metadata presents the key for all of them.
        self._sessions = [MuxClient(functools.partial(stub.GenerateMux, metadata=self._metadata),
                                    router_pb2.GenerateResponse) for stub in self._stubs]
        self._health = [health_pb2_grpc.HealthStub(channel) for channel in self._channels]
        self._redis = redis_client.connect(config.redis_url, socket_connect_timeout=config.health_timeout_s,
                                        socket_timeout=config.health_timeout_s)
        self._registry = WorkerRegistry(self._redis, lease_s=0)

    def generate(self, request: router_pb2.GenerateRequest, params: Mapping[str, str]) -> RouterAnswer:
        """Starts the call; `params` maps router field names to the client's for 400 messages."""
        first = next(self._next_router)

        def start(attempt_request: router_pb2.GenerateRequest, attempt: int) -> grpc.aio.UnaryStreamCall | MuxCall:
            which = (first + attempt) % len(self._stubs)
            if self._config.router_mux and MuxClient.fits(attempt_request):
                return self._sessions[which].call(attempt_request, tracing.inject_headers({}),
                                                  timeout=self._config.request_timeout_s)
            return self._stubs[which].Generate(attempt_request, timeout=self._config.request_timeout_s,
                                               metadata=self._metadata)

        async def ready(attempt: int) -> None:
            channel = self._channels[(first + attempt) % len(self._channels)]
            try:
                await asyncio.wait_for(channel.channel_ready(), self._config.router_retry_wait_s)
            except asyncio.TimeoutError:
                pass  # the call fails at once, with the router's error

        return RouterAnswer(start, request, params, self._config.retry_after_s, len(self._stubs), ready)

    async def tokenize(self, request: router_pb2.TokenizeRequest,
                       params: Mapping[str, str]) -> router_pb2.TokenizeResponse:
        """The router's Tokenize; a failure raises the client's ApiError (`params`: as for generate)."""
        return await self._unary("Tokenize", request, params)

    async def detokenize(self, request: router_pb2.DetokenizeRequest,
                         params: Mapping[str, str]) -> router_pb2.DetokenizeResponse:
        """The router's Detokenize; a failure raises the client's ApiError (`params`: as for generate)."""
        return await self._unary("Detokenize", request, params)

    async def _unary(self, method_name: str, request, params: Mapping[str, str]):
        method = getattr(self._stubs[next(self._next_router) % len(self._stubs)], method_name)
        try:
            return await method(request, timeout=self._config.request_timeout_s, metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            raise from_router_error(exc.code(), exc.details(), params, self._config.retry_after_s) from None

    async def readiness_problems(self) -> list[str]:
        """Why the system cannot serve now: router down, or neither a colocated worker nor a prefill and a
        decode worker. Empty: ready."""
        router_problems = [p for p in await asyncio.gather(*map(self._router_problem, self._addresses, self._health))
                           if p]
        problems = router_problems if len(router_problems) == len(self._addresses) else []  # one serving is enough
        try:
            counts = {role: len(await asyncio.wait_for(self._registry.list(role), self._config.health_timeout_s))
                      for role in ("prefill", "decode", "colocated")}
        except (aioredis.RedisError, OSError, asyncio.TimeoutError) as exc:
            problems.append(f"worker registry unreachable: {type(exc).__name__}")
            return problems
        if not counts["colocated"]:  # otherwise colocated workers serve alone
            problems += [f"no {role} worker is registered" for role in ("prefill", "decode") if not counts[role]]
        return problems

    async def _router_problem(self, address: str, health: health_pb2_grpc.HealthStub) -> str:
        try:
            reply = await health.Check(health_pb2.HealthCheckRequest(service=ROUTER_SERVICE),
                                       timeout=self._config.health_timeout_s)
        except grpc.aio.AioRpcError as exc:
            return f"router at {address} is unreachable: {exc.code().name}"
        return "" if reply.status == health_pb2.HealthCheckResponse.SERVING else f"router at {address} is not serving"

    async def close(self) -> None:
        for session in self._sessions:
            await session.close()
        for channel in self._channels:
            await channel.close()
        await self._redis.aclose()
