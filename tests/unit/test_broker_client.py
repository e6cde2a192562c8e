"""BrokerClient's background release: retried while the kvbroker is unreachable, given up on otherwise."""

from __future__ import annotations

import grpc
import pytest

from distserve import broker_client
from distserve.broker_client import BrokerClient
from distserve.v1 import kvbroker_pb2


class FakeBrokerStub:
    """ReleaseHandle fails with each of `failures` in turn, then succeeds; records every call."""

    def __init__(self, failures: list[grpc.StatusCode]):
        self.failures = list(failures)
        self.calls: list[str] = []

    async def ReleaseHandle(self, request, timeout):  # noqa: N802 (the gRPC method's name)
        self.calls.append(request.handle_id)
        if self.failures:
            code = self.failures.pop(0)
            raise grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=code.name)
        return kvbroker_pb2.ReleaseHandleResponse(existed=True)


def client_with(stub: FakeBrokerStub) -> BrokerClient:
    client = BrokerClient.__new__(BrokerClient)
    client._stub, client._timeout_s, client._pending = stub, 1.0, set()
    return client


@pytest.fixture(autouse=True)
def fast_backoff(monkeypatch):
    monkeypatch.setattr(broker_client, "RELEASE_BACKOFF_S", (0.01, 0.02))


async def test_a_release_while_the_broker_restarts_is_retried_until_it_lands():
    stub = FakeBrokerStub([grpc.StatusCode.UNAVAILABLE] * 3)
    reply = await client_with(stub).release_soon("h1", "received", "r1")
    assert reply.existed and stub.calls == ["h1"] * 4


async def test_other_errors_are_not_retried(caplog):
    stub = FakeBrokerStub([grpc.StatusCode.INVALID_ARGUMENT])
    with pytest.raises(grpc.aio.AioRpcError):
        await client_with(stub).release_soon("h1", "received", "r1")
    assert stub.calls == ["h1"]


async def test_retries_stop_after_the_retry_window(monkeypatch):
    monkeypatch.setattr(broker_client, "RELEASE_RETRY_S", 0.05)
    stub = FakeBrokerStub([grpc.StatusCode.UNAVAILABLE] * 100)
    with pytest.raises(grpc.aio.AioRpcError):
        await client_with(stub).release_soon("h1", "received", "r1")
    assert 1 < len(stub.calls) < 100
