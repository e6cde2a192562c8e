"""The gateway's only peers: the router (one gRPC channel) and the worker registry (for /health)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import grpc
import redis.asyncio as aioredis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from distserve import redis_client
from distserve import tracing
from distserve.bearer_key import call_metadata
from distserve.grpc_server import aio_channel
from distserve.registry import WorkerRegistry
from distserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from services.router.gateway.config import GatewayConfig
from services.router.gateway.errors import from_router_error, internal_error

ROUTER_SERVICE = "distserve.v1.RouterService"


class RouterAnswer:
    """One Generate call, read message by message; a failed call raises the client's ApiError.

    `cancel()` must run when the caller stops reading for any reason (finished,
    client gone, error): it is what makes the router cancel the workers.
    """

    def __init__(self, call: grpc.aio.UnaryStreamCall, params: Mapping[str, str], retry_after_s: int,
                 num_completions: int = 1):
        self._call = call
        self._params = params
        self._retry_after_s = retry_after_s
        self._unfinished = num_completions
        self._finished = False

    async def next(self) -> router_pb2.GenerateResponse | None:
        """The next message; None once every completion's message with a finish reason has been returned."""
        if self._finished:
            return None
        try:
            message = await self._call.read()
        except grpc.aio.AioRpcError as exc:
            raise from_router_error(exc.code(), exc.details(), self._params, self._retry_after_s) from None
        if message is grpc.aio.EOF:
            raise internal_error("the router ended the stream without a finish reason")
        if message.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
            self._unfinished -= 1
            self._finished = self._unfinished <= 0
        return message

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
        self._channel = aio_channel(config.router_address, config, tracing.client_interceptors())
        self._stub = router_pb2_grpc.RouterServiceStub(self._channel)
        self._metadata = call_metadata(config.api_key)  # the router wants the deployment's key too
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._redis = redis_client.connect(config.redis_url, socket_connect_timeout=config.health_timeout_s,
                                        socket_timeout=config.health_timeout_s)
        self._registry = WorkerRegistry(self._redis, lease_s=0)

    def generate(self, request: router_pb2.GenerateRequest, params: Mapping[str, str]) -> RouterAnswer:
        """Starts the call; `params` maps router field names to the client's for 400 messages."""
        call = self._stub.Generate(request, timeout=self._config.request_timeout_s, metadata=self._metadata)
        return RouterAnswer(call, params, self._config.retry_after_s, max(request.n, 1))

    async def tokenize(self, request: router_pb2.TokenizeRequest,
                       params: Mapping[str, str]) -> router_pb2.TokenizeResponse:
        """The router's Tokenize; a failure raises the client's ApiError (`params`: as for generate)."""
        return await self._unary(self._stub.Tokenize, request, params)

    async def detokenize(self, request: router_pb2.DetokenizeRequest,
                         params: Mapping[str, str]) -> router_pb2.DetokenizeResponse:
        """The router's Detokenize; a failure raises the client's ApiError (`params`: as for generate)."""
        return await self._unary(self._stub.Detokenize, request, params)

    async def _unary(self, method, request, params: Mapping[str, str]):
        try:
            return await method(request, timeout=self._config.request_timeout_s, metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            raise from_router_error(exc.code(), exc.details(), params, self._config.retry_after_s) from None

    async def readiness_problems(self) -> list[str]:
        """Why the system cannot serve now: router down, or neither a colocated worker nor a prefill and a
        decode worker. Empty: ready."""
        problems = []
        try:
            reply = await self._health.Check(health_pb2.HealthCheckRequest(service=ROUTER_SERVICE),
                                             timeout=self._config.health_timeout_s)
            if reply.status != health_pb2.HealthCheckResponse.SERVING:
                problems.append(f"router at {self._config.router_address} is not serving")
        except grpc.aio.AioRpcError as exc:
            problems.append(f"router at {self._config.router_address} is unreachable: {exc.code().name}")
        try:
            counts = {role: len(await asyncio.wait_for(self._registry.list(role), self._config.health_timeout_s))
                      for role in ("prefill", "decode", "colocated")}
        except (aioredis.RedisError, OSError, asyncio.TimeoutError) as exc:
            problems.append(f"worker registry unreachable: {type(exc).__name__}")
            return problems
        if not counts["colocated"]:  # otherwise colocated workers serve alone
            problems += [f"no {role} worker is registered" for role in ("prefill", "decode") if not counts[role]]
        return problems

    async def close(self) -> None:
        await self._channel.close()
        await self._redis.aclose()
