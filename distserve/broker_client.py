"""The kvbroker client every service uses: deadlines on each call, failover between kvbroker replicas,
releases that outlive cancellation.

Replicas: `--broker-address` may name several kvbrokers, comma-separated. They keep no state of their
own (handles live in Redis), so any of them serves any call. A call goes to the replica that answered
last; when that one is unreachable (UNAVAILABLE: killed, restarting) or stalled (DEADLINE_EXCEEDED) the
call moves on to the next, each replica tried once per call. The last replica tried, when its channel
is not connected, waits for the connection (gRPC's wait_for_ready) for at most RECONNECT_WAIT_S rather
than failing fast: a kvbroker restarted a moment ago is back before the channel's reconnect backoff
ends, and the call must not be refused for that; one that stays down costs the call that long. Moving a call that may have landed is safe:
a register that landed reads ALREADY_EXISTS on the next replica, which counts as done here, a claim
repeated by its claimant returns the same handle (services.kvbroker.store), and a release is idempotent.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Sequence

import grpc

from distserve.config import ConfigError
from distserve.v1 import kvbroker_pb2, kvbroker_pb2_grpc

log = logging.getLogger(__name__)

# A release that finds every kvbroker down (or stalled) is retried, with backoff, until a wait would end
# past this long; a try already started runs to its own deadline, so the whole may take up to a call's
# timeout more. A lost release leaves the handle's record, and the owner's KV, held until the claim lease
# runs out. Releasing is idempotent, so a retry after a release that did land is harmless.
RELEASE_RETRY_S = 15.0
RELEASE_BACKOFF_S = (0.1, 1.0)  # first wait, longest wait
# How long a call's last try waits for a channel that is not connected: the channels' longest reconnect
# backoff (2 s, distserve.grpc_server.CHANNEL_OPTIONS) and a connect.
RECONNECT_WAIT_S = 2.5
# Codes that say "this replica, not the request": the next replica gets the call.
FAILOVER_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


def broker_addresses(setting: str) -> list[str]:
    """The kvbroker addresses in a `--broker-address` setting ("host:port[,host:port...]")."""
    addresses = [a.strip() for a in setting.split(",") if a.strip()]
    if not addresses:
        raise ConfigError(f"broker_address: at least one host:port, got {setting!r}")
    return addresses


class BrokerClient:
    def __init__(self, channels: Sequence[grpc.aio.Channel], timeout_s: float):
        """channels: one per kvbroker replica, in the order to try them."""
        if not channels:
            raise ValueError("BrokerClient needs at least one kvbroker channel")
        self._channels = list(channels)
        self._stubs = [kvbroker_pb2_grpc.KvBrokerServiceStub(channel) for channel in channels]
        self._current = 0  # the replica that answered last
        self._timeout_s = timeout_s
        self._pending: set[asyncio.Future] = set()

    @classmethod
    def over(cls, pool, setting: str, timeout_s: float) -> "BrokerClient":
        """A client of the kvbrokers a `--broker-address` setting names, on channels from `pool` (a
        distserve.grpc_server.ChannelPool)."""
        return cls([pool.get(address) for address in broker_addresses(setting)], timeout_s)

    async def _call(self, method: str, request, landed: frozenset[grpc.StatusCode] = frozenset()):
        """The reply of the first replica that answers; None when a replica after the first answers with a
        code in `landed` (the call had landed on one that failed). Raises the last replica's error."""
        first = self._current  # read once: calls finishing meanwhile move it, and this call must try each once
        for attempt in range(len(self._stubs)):
            index = (first + attempt) % len(self._stubs)
            last = attempt == len(self._stubs) - 1
            try:
                reply = await getattr(self._stubs[index], method)(request, **self._call_options(index, last))
            except grpc.aio.AioRpcError as exc:
                if attempt and exc.code() in landed:
                    self._current = index
                    return None
                if exc.code() not in FAILOVER_CODES or last:
                    raise
                log.warning("kvbroker %d of %d: %s on %s; trying the next", index + 1, len(self._stubs),
                            exc.code().name, method)
                continue
            self._current = index
            return reply
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _call_options(self, index: int, last: bool) -> dict:
        """The call's deadline, and whether it waits for the channel's connection (see the module docstring)."""
        if last and self._channels[index].get_state() != grpc.ChannelConnectivity.READY:
            return {"timeout": min(self._timeout_s, RECONNECT_WAIT_S), "wait_for_ready": True}
        return {"timeout": self._timeout_s, "wait_for_ready": False}

    async def register(self, handle: kvbroker_pb2.KvHandle, lease_s: float) -> None:
        await self._call("RegisterHandle", kvbroker_pb2.RegisterHandleRequest(handle=handle, lease_s=lease_s),
                         landed=frozenset({grpc.StatusCode.ALREADY_EXISTS}))

    async def claim(self, handle_id: str, claimant: str, request_id: str) -> kvbroker_pb2.KvHandle:
        reply = await self._call("ClaimHandle", kvbroker_pb2.ClaimHandleRequest(
            handle_id=handle_id, claimant_worker_id=claimant, request_id=request_id))
        return reply.handle

    def release_soon(self, handle_id: str, reason: str, request_id: str) -> asyncio.Future:
        """Releases the handle in the background, so it completes even while the caller is cancelled.

        The returned future may be waited on (asyncio.wait: it never raises) to keep the release inside
        the caller's span; while no kvbroker is reachable it retries (RELEASE_RETRY_S).
        """
        request = kvbroker_pb2.ReleaseHandleRequest(handle_id=handle_id, reason=reason, request_id=request_id)
        future = asyncio.ensure_future(self._release(request))
        self._pending.add(future)
        future.add_done_callback(self._done)
        return future

    async def _release(self, request: kvbroker_pb2.ReleaseHandleRequest) -> kvbroker_pb2.ReleaseHandleResponse:
        """One release, retried while no replica answers in time (see RELEASE_RETRY_S)."""
        deadline = asyncio.get_running_loop().time() + RELEASE_RETRY_S
        wait_s, longest_s = RELEASE_BACKOFF_S
        while True:
            try:
                return await self._call("ReleaseHandle", request)
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in FAILOVER_CODES or asyncio.get_running_loop().time() + wait_s > deadline:
                    raise
            await asyncio.sleep(wait_s)
            wait_s = min(2 * wait_s, longest_s)

    def _done(self, future: asyncio.Future) -> None:
        self._pending.discard(future)
        if not future.cancelled() and future.exception() is not None:
            log.warning("kv handle release failed: %s", future.exception())
