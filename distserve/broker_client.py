"""The kvbroker client every service uses: deadlines on each call, releases that outlive cancellation."""

from __future__ import annotations

import asyncio
import logging

import grpc

from distserve.v1 import kvbroker_pb2, kvbroker_pb2_grpc

log = logging.getLogger(__name__)


class BrokerClient:
    def __init__(self, channel: grpc.aio.Channel, timeout_s: float):
        self._stub = kvbroker_pb2_grpc.KvBrokerServiceStub(channel)
        self._timeout_s = timeout_s
        self._pending: set[asyncio.Future] = set()

    async def register(self, handle: kvbroker_pb2.KvHandle, lease_s: float) -> kvbroker_pb2.KvHandle:
        reply = await self._stub.RegisterHandle(
            kvbroker_pb2.RegisterHandleRequest(handle=handle, lease_s=lease_s), timeout=self._timeout_s)
        return reply.handle

    async def claim(self, handle_id: str, claimant: str, request_id: str) -> kvbroker_pb2.KvHandle:
        reply = await self._stub.ClaimHandle(
            kvbroker_pb2.ClaimHandleRequest(handle_id=handle_id, claimant_worker_id=claimant, request_id=request_id),
            timeout=self._timeout_s)
        return reply.handle

    def release_soon(self, handle_id: str, reason: str, request_id: str) -> asyncio.Future:
        """Releases the handle in the background, so it completes even while the caller is cancelled.

        The returned future may be awaited (it never raises) to keep the release inside the caller's span.
        """
        future = asyncio.ensure_future(self._stub.ReleaseHandle(
            kvbroker_pb2.ReleaseHandleRequest(handle_id=handle_id, reason=reason, request_id=request_id),
            timeout=self._timeout_s))
        self._pending.add(future)
        future.add_done_callback(self._done)
        return future

    def _done(self, future: asyncio.Future) -> None:
        self._pending.discard(future)
        if not future.cancelled() and future.exception() is not None:
            log.warning("kv handle release failed: %s", future.exception())
