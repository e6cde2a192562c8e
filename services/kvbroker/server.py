"""The kvbroker gRPC servicer: validates requests and maps store outcomes to status codes."""

from __future__ import annotations

import logging
import sys

import grpc

from distserve.v1 import kvbroker_pb2, kvbroker_pb2_grpc
from services.kvbroker.config import KvBrokerConfig
from services.kvbroker.store import HandleNotFound, HandleNotReady, HandleStore

log = logging.getLogger(__name__)


class KvBrokerServicer(kvbroker_pb2_grpc.KvBrokerServiceServicer):
    def __init__(self, store: HandleStore, config: KvBrokerConfig):
        self._store = store
        self._config = config
        self._stats = kvbroker_pb2.GetBrokerStatsResponse()

    def _count_request(self, request) -> None:
        self._stats.max_request_bytes = max(self._stats.max_request_bytes, request.ByteSize())

    async def RegisterHandle(self, request, context):
        self._count_request(request)
        handle = request.handle
        for field, ok in (
            ("handle.handle_id", bool(handle.handle_id)),
            ("handle.owner_worker_id", bool(handle.owner_worker_id)),
            ("handle.owner_ucx_address", ":" in handle.owner_ucx_address),
            ("handle.layout.num_bytes", handle.layout.num_bytes > 0),
            ("lease_s", request.lease_s >= 0),
        ):
            if not ok:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{field} is missing or invalid")
        stored = await self._store.register(handle, request.lease_s or self._config.default_lease_s)
        self._stats.num_registered += 1
        log.info("register handle=%s request_id=%s bytes=%d owner=%s", handle.handle_id,
                 handle.request_id, handle.layout.num_bytes, handle.owner_worker_id)
        return kvbroker_pb2.RegisterHandleResponse(handle=stored)

    async def ClaimHandle(self, request, context):
        self._count_request(request)
        if not request.handle_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "handle_id is required")
        try:
            handle = await self._store.claim(request.handle_id, request.claimant_worker_id,
                                             self._config.claim_lease_s)
        except HandleNotFound:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"handle {request.handle_id} not found or expired")
        except HandleNotReady:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"handle {request.handle_id} already claimed")
        self._stats.num_claimed += 1
        log.info("claim handle=%s request_id=%s by=%s", handle.handle_id, handle.request_id,
                 request.claimant_worker_id)
        return kvbroker_pb2.ClaimHandleResponse(handle=handle)

    async def ReleaseHandle(self, request, context):
        self._count_request(request)
        if not request.handle_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "handle_id is required")
        existed = await self._store.release(request.handle_id)
        self._stats.num_released += 1
        log.info("release handle=%s reason=%s existed=%s", request.handle_id, request.reason, existed)
        return kvbroker_pb2.ReleaseHandleResponse(existed=existed)

    async def GetBrokerStats(self, request, context):
        stats = kvbroker_pb2.GetBrokerStatsResponse()
        stats.CopyFrom(self._stats)
        stats.ucx_loaded = "ucxx" in sys.modules
        return stats
