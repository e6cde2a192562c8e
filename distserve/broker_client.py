"""The kvbroker client every service uses: deadlines on each call, releases that outlive cancellation."""

from __future__ import annotations

import asyncio
import logging

import grpc

from distserve.v1 import kvbroker_pb2, kvbroker_pb2_grpc

log = logging.getLogger(__name__)

# A release that finds the kvbroker down (UNAVAILABLE: killed, restarting) is retried this long, with
# backoff: a lost release leaves the handle's record, and the owner's KV, held until the claim lease
# runs out. Releasing is idempotent, so a retry after a release that did land is harmless.
RELEASE_RETRY_S = 15.0
RELEASE_BACKOFF_S = (0.1, 1.0)  # first wait, longest wait


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

        The returned future may be waited on (asyncio.wait: it never raises) to keep the release inside
        the caller's span; while the broker is unreachable it retries (RELEASE_RETRY_S).
        """
        request = kvbroker_pb2.ReleaseHandleRequest(handle_id=handle_id, reason=reason, request_id=request_id)
        future = asyncio.ensure_future(self._release(request))
        self._pending.add(future)
        future.add_done_callback(self._done)
        return future

    async def _release(self, request: kvbroker_pb2.ReleaseHandleRequest) -> kvbroker_pb2.ReleaseHandleResponse:
        """One release, retried while the broker is unreachable (see RELEASE_RETRY_S)."""
        deadline = asyncio.get_running_loop().time() + RELEASE_RETRY_S
        wait_s, longest_s = RELEASE_BACKOFF_S
        while True:
            try:
                return await self._stub.ReleaseHandle(request, timeout=self._timeout_s)
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE or asyncio.get_running_loop().time() + wait_s > deadline:
                    raise
            await asyncio.sleep(wait_s)
            wait_s = min(2 * wait_s, longest_s)

    def _done(self, future: asyncio.Future) -> None:
        self._pending.discard(future)
        if not future.cancelled() and future.exception() is not None:
            log.warning("kv handle release failed: %s", future.exception())
