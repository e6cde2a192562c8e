"""BrokerClient: failover between kvbroker replicas, and background releases retried while every
replica is unreachable, given up on otherwise."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from distserve import broker_client
from distserve.broker_client import BrokerClient, broker_addresses
from distserve.config import ConfigError
from distserve.grpc_server import PLAINTEXT, aio_channel
from distserve.ports import free_port
from distserve.v1 import kvbroker_pb2, kvbroker_pb2_grpc


def rpc_error(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=code.name)


class FakeBrokerStub:
    """Each call fails with each of `failures` in turn, then succeeds; records every call's method."""

    def __init__(self, failures: list[grpc.StatusCode] = ()):
        self.failures = list(failures)
        self.calls: list[str] = []
        self.waited_for_ready: list[bool] = []

    def _answer(self, method: str, reply, wait_for_ready: bool):
        self.calls.append(method)
        self.waited_for_ready.append(wait_for_ready)
        if self.failures:
            raise rpc_error(self.failures.pop(0))
        return reply

    async def ReleaseHandle(self, request, timeout, wait_for_ready):  # noqa: N802 (the gRPC method's name)
        return self._answer("release", kvbroker_pb2.ReleaseHandleResponse(existed=True), wait_for_ready)

    async def RegisterHandle(self, request, timeout, wait_for_ready):  # noqa: N802
        return self._answer("register", kvbroker_pb2.RegisterHandleResponse(handle=request.handle), wait_for_ready)

    async def ClaimHandle(self, request, timeout, wait_for_ready):  # noqa: N802
        return self._answer("claim", kvbroker_pb2.ClaimHandleResponse(
            handle=kvbroker_pb2.KvHandle(handle_id=request.handle_id, claimed_by=request.claimant_worker_id)),
            wait_for_ready)


class UnusedChannel:
    """Enough of a channel for the real stubs to be built (the fakes replace them), in a connectivity state."""

    def __init__(self, state: grpc.ChannelConnectivity = grpc.ChannelConnectivity.READY):
        self.state = state

    def unary_unary(self, *args, **kwargs):
        return None

    def get_state(self, try_to_connect: bool = False) -> grpc.ChannelConnectivity:
        return self.state


def client_with(*stubs: FakeBrokerStub, state: grpc.ChannelConnectivity = grpc.ChannelConnectivity.READY) -> BrokerClient:
    client = BrokerClient([UnusedChannel(state) for _ in stubs], timeout_s=1.0)
    client._stubs = list(stubs)
    return client


@pytest.fixture(autouse=True)
def fast_backoff(monkeypatch):
    monkeypatch.setattr(broker_client, "RELEASE_BACKOFF_S", (0.01, 0.02))


async def test_a_release_while_the_broker_restarts_is_retried_until_it_lands():
    stub = FakeBrokerStub([grpc.StatusCode.UNAVAILABLE] * 3)
    reply = await client_with(stub).release_soon("h1", "received", "r1")
    assert reply.existed and stub.calls == ["release"] * 4


async def test_other_errors_are_not_retried():
    stub = FakeBrokerStub([grpc.StatusCode.INVALID_ARGUMENT])
    with pytest.raises(grpc.aio.AioRpcError):
        await client_with(stub).release_soon("h1", "received", "r1")
    assert stub.calls == ["release"]


async def test_retries_stop_after_the_retry_window(monkeypatch):
    monkeypatch.setattr(broker_client, "RELEASE_RETRY_S", 0.05)
    stub = FakeBrokerStub([grpc.StatusCode.UNAVAILABLE] * 100)
    with pytest.raises(grpc.aio.AioRpcError):
        await client_with(stub).release_soon("h1", "received", "r1")
    assert 1 < len(stub.calls) < 100


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED])
async def test_a_dead_or_stalled_replica_passes_the_call_on_and_the_next_calls_start_at_the_other(code):
    dead, live = FakeBrokerStub([code]), FakeBrokerStub()
    client = client_with(dead, live)
    claimed = await client.claim("h1", "decode-b", "r1")
    assert claimed.claimed_by == "decode-b" and dead.calls == live.calls == ["claim"]
    await client.release_soon("h1", "done", "r1")
    assert dead.calls == ["claim"] and live.calls == ["claim", "release"]


async def test_a_register_that_landed_before_its_replica_failed_counts_as_done():
    landed, other = FakeBrokerStub([grpc.StatusCode.UNAVAILABLE]), FakeBrokerStub([grpc.StatusCode.ALREADY_EXISTS])
    await client_with(landed, other).register(kvbroker_pb2.KvHandle(handle_id="h1"), lease_s=5)
    assert landed.calls == other.calls == ["register"]


async def test_already_exists_from_the_first_replica_tried_is_an_error():
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await client_with(FakeBrokerStub([grpc.StatusCode.ALREADY_EXISTS]), FakeBrokerStub()).register(
            kvbroker_pb2.KvHandle(handle_id="h1"), lease_s=5)
    assert raised.value.code() == grpc.StatusCode.ALREADY_EXISTS


async def test_errors_of_the_request_are_not_passed_on():
    first, second = FakeBrokerStub([grpc.StatusCode.NOT_FOUND]), FakeBrokerStub()
    with pytest.raises(grpc.aio.AioRpcError):
        await client_with(first, second).claim("h1", "decode-b", "r1")
    assert second.calls == []


async def test_with_every_replica_down_the_last_ones_error_is_raised():
    stubs = [FakeBrokerStub([grpc.StatusCode.UNAVAILABLE]), FakeBrokerStub([grpc.StatusCode.DEADLINE_EXCEEDED])]
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await client_with(*stubs).claim("h1", "decode-b", "r1")
    assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


async def test_only_the_last_replica_tried_waits_for_its_connection_and_only_while_unconnected():
    """Earlier replicas fail fast so the call moves on; the last one waits for a kvbroker that is coming
    back, and a connected one is called as usual."""
    first, last = FakeBrokerStub([grpc.StatusCode.UNAVAILABLE]), FakeBrokerStub()
    await client_with(first, last, state=grpc.ChannelConnectivity.TRANSIENT_FAILURE).register(
        kvbroker_pb2.KvHandle(handle_id="h1"), lease_s=5)
    assert first.waited_for_ready == [False] and last.waited_for_ready == [True]
    connected = FakeBrokerStub()
    await client_with(connected).register(kvbroker_pb2.KvHandle(handle_id="h1"), lease_s=5)
    assert connected.waited_for_ready == [False]


class Broker(kvbroker_pb2_grpc.KvBrokerServiceServicer):
    async def RegisterHandle(self, request, context):  # noqa: N802
        return kvbroker_pb2.RegisterHandleResponse(handle=request.handle)


async def serve_broker(port: int) -> grpc.aio.Server:
    server = grpc.aio.server()
    kvbroker_pb2_grpc.add_KvBrokerServiceServicer_to_server(Broker(), server)
    assert server.add_insecure_port(f"127.0.0.1:{port}") == port
    await server.start()
    return server


async def test_a_kvbroker_restarted_a_moment_ago_is_called_not_refused():
    """A call that found the kvbroker down left the channel in its reconnect backoff; a call right after
    the kvbroker came back on the same port waits out the backoff and lands, with our channel options."""
    port = free_port()
    server = await serve_broker(port)
    channel = aio_channel(f"127.0.0.1:{port}", PLAINTEXT)
    client = BrokerClient([channel], timeout_s=5.0)
    try:
        await client.register(kvbroker_pb2.KvHandle(handle_id="h1"), lease_s=5)
        await server.stop(grace=None)
        started = asyncio.get_running_loop().time()
        with pytest.raises(grpc.aio.AioRpcError):  # down: refused after the reconnect wait, not the deadline
            await client.register(kvbroker_pb2.KvHandle(handle_id="h2"), lease_s=5)
        assert asyncio.get_running_loop().time() - started < broker_client.RECONNECT_WAIT_S + 1.0
        server = await serve_broker(port)
        await client.register(kvbroker_pb2.KvHandle(handle_id="h3"), lease_s=5)
    finally:
        await channel.close()
        await server.stop(grace=None)


def test_addresses_are_comma_separated_and_at_least_one():
    assert broker_addresses("a:1, b:2,") == ["a:1", "b:2"]
    with pytest.raises(ConfigError, match="broker_address"):
        broker_addresses(" , ")


class StalledStub(FakeBrokerStub):
    """Its calls wait for `release`, then fail DEADLINE_EXCEEDED: a stalled replica's calls in flight."""

    def __init__(self):
        super().__init__()
        self.release = asyncio.Event()

    async def ClaimHandle(self, request, timeout, wait_for_ready):  # noqa: N802
        self.calls.append("claim")
        await self.release.wait()
        raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED)


async def test_calls_in_flight_when_another_moved_on_still_try_each_replica_once():
    stalled, live = StalledStub(), FakeBrokerStub()
    client = client_with(stalled, live)
    waiting = [asyncio.ensure_future(client.claim(f"h{i}", "decode-b", "r")) for i in range(3)]
    await asyncio.sleep(0)
    stalled.release.set()  # the first to time out moves the client to `live` before the others time out
    claimed = await asyncio.gather(*waiting)
    assert [c.handle_id for c in claimed] == ["h0", "h1", "h2"]
    assert stalled.calls == live.calls == ["claim"] * 3
