"""The kvbroker gRPC servicer: validates requests and maps store outcomes to status codes."""

from __future__ import annotations

import functools
import logging
import sys

import grpc
import redis

from distserve import tracing
from distserve.metrics import BrokerMetrics
from distserve.v1 import kvbroker_pb2, kvbroker_pb2_grpc
from services.kvbroker.config import KvBrokerConfig
from services.kvbroker.store import HandleExists, HandleForged, HandleNotFound, HandleNotReady, HandleStore

log = logging.getLogger(__name__)


def register_error(request: kvbroker_pb2.RegisterHandleRequest) -> str | None:
    handle = request.handle
    for field, ok in (
        ("handle.handle_id", bool(handle.handle_id)),
        ("handle.owner_worker_id", bool(handle.owner_worker_id)),
        ("handle.owner_ucx_address", ":" in handle.owner_ucx_address),
        ("handle.layout.num_bytes", handle.layout.num_bytes > 0),
        ("lease_s", request.lease_s >= 0),
    ):
        if not ok:
            return f"{field}: missing or invalid"
    return None


def redis_down_is_unavailable(method):
    """Redis unreachable (restarting, network) is UNAVAILABLE to callers, a state they can retry
    or wait out, not the UNKNOWN an escaping ConnectionError would become."""
    @functools.wraps(method)
    async def wrapper(self, request, context):
        try:
            return await method(self, request, context)
        except (redis.RedisError, OSError) as exc:
            log.warning("%s: redis unavailable: %r", method.__name__, exc)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"kvbroker's Redis is unavailable: {exc}")
    return wrapper


class KvBrokerServicer(kvbroker_pb2_grpc.KvBrokerServiceServicer):
    def __init__(self, store: HandleStore, config: KvBrokerConfig, metrics: BrokerMetrics):
        self._store = store
        self._config = config
        self._metrics = metrics
        self._stats = kvbroker_pb2.GetBrokerStatsResponse()

    def _count(self, request, operation: str, outcome: str) -> None:
        self._stats.max_request_bytes = max(self._stats.max_request_bytes, request.ByteSize())
        self._metrics.operations.labels(operation=operation, outcome=outcome).inc()

    @redis_down_is_unavailable
    async def RegisterHandle(self, request, context):
        handle = request.handle
        with tracing.server_context(context), tracing.span("register", handle.request_id,
                                                           **{"distserve.kv.handle_id": handle.handle_id,
                                                              "distserve.kv.bytes": handle.layout.num_bytes}):
            error = register_error(request)
            if error:
                self._count(request, "register", "invalid")
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, error)
            try:
                stored = await self._store.register(handle, request.lease_s or self._config.default_lease_s)
            except HandleExists:
                self._count(request, "register", "exists")
                await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"handle {handle.handle_id} already registered")
            self._count(request, "register", "ok")
            self._stats.num_registered += 1
            log.info("register handle=%s request_id=%s bytes=%d owner=%s", handle.handle_id,
                     handle.request_id, handle.layout.num_bytes, handle.owner_worker_id)
            return kvbroker_pb2.RegisterHandleResponse(handle=stored)

    @redis_down_is_unavailable
    async def ClaimHandle(self, request, context):
        with tracing.server_context(context), tracing.span("claim", request.request_id,
                                                           **{"distserve.kv.handle_id": request.handle_id,
                                                              "distserve.kv.claimant": request.claimant_worker_id}):
            if not request.handle_id:
                self._count(request, "claim", "invalid")
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "handle_id: required")
            try:
                handle = await self._store.claim(request.handle_id, request.claimant_worker_id,
                                                 self._config.claim_lease_s)
            except HandleNotFound:
                self._count(request, "claim", "not_found")
                await context.abort(grpc.StatusCode.NOT_FOUND, f"handle {request.handle_id} not found or expired")
            except HandleNotReady:
                self._count(request, "claim", "already_claimed")
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"handle {request.handle_id} already claimed")
            except HandleForged:
                self._count(request, "claim", "bad_signature")
                await context.abort(grpc.StatusCode.DATA_LOSS, f"handle {request.handle_id}: its record in Redis "
                                    "fails its signature check (forged or rewritten); not handed out")
            self._count(request, "claim", "ok")
            self._stats.num_claimed += 1
            log.info("claim handle=%s request_id=%s by=%s", handle.handle_id, handle.request_id,
                     request.claimant_worker_id)
            return kvbroker_pb2.ClaimHandleResponse(handle=handle)

    @redis_down_is_unavailable
    async def ReleaseHandle(self, request, context):
        with tracing.server_context(context), tracing.span("release", request.request_id,
                                                           **{"distserve.kv.handle_id": request.handle_id,
                                                              "distserve.kv.release_reason": request.reason}):
            if not request.handle_id:
                self._count(request, "release", "invalid")
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "handle_id: required")
            existed = await self._store.release(request.handle_id)
            self._count(request, "release", "ok" if existed else "gone")
            self._stats.num_released += 1
            log.info("release handle=%s request_id=%s reason=%s existed=%s", request.handle_id, request.request_id,
                     request.reason, existed)
            return kvbroker_pb2.ReleaseHandleResponse(existed=existed)

    @redis_down_is_unavailable
    async def GetBrokerStats(self, request, context):
        stats = kvbroker_pb2.GetBrokerStatsResponse()
        stats.CopyFrom(self._stats)
        stats.ucx_loaded = "ucxx" in sys.modules
        return stats
