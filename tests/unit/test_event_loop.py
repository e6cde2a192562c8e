"""The services' event loop: uvloop unless DISTSERVE_EVENT_LOOP says otherwise, and grpc.aio on it."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from distserve import event_loop


def test_uvloop_is_the_default_and_the_variable_chooses(monkeypatch):
    import uvloop

    monkeypatch.delenv("DISTSERVE_EVENT_LOOP", raising=False)
    assert event_loop.chosen() == "uvloop"
    loop = event_loop.new_loop()
    assert isinstance(loop, uvloop.Loop)
    loop.close()
    monkeypatch.setenv("DISTSERVE_EVENT_LOOP", "asyncio")
    loop = event_loop.new_loop()
    assert not isinstance(loop, uvloop.Loop)
    loop.close()
    monkeypatch.setenv("DISTSERVE_EVENT_LOOP", "tokio")
    with pytest.raises(ValueError, match="DISTSERVE_EVENT_LOOP"):
        event_loop.chosen()


@pytest.mark.parametrize("kind", event_loop.CHOICES)
def test_grpc_aio_streams_and_cancels_on_each_loop(monkeypatch, kind):
    """A server-streaming call (read() to the end) and a cancelled one, both ends on the same loop."""
    monkeypatch.setenv("DISTSERVE_EVENT_LOOP", kind)

    async def main() -> list[int]:
        server = grpc.aio.server()
        servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                await servicer.set("svc", health_pb2.HealthCheckResponse.SERVING)
                call = stub.Watch(health_pb2.HealthCheckRequest(service="svc"))
                seen = [(await call.read()).status]
                await servicer.set("svc", health_pb2.HealthCheckResponse.NOT_SERVING)
                seen.append((await call.read()).status)
                call.cancel()
                assert await call.code() == grpc.StatusCode.CANCELLED
                reply = await stub.Check(health_pb2.HealthCheckRequest(service="svc"))
                return seen + [reply.status]
        finally:
            await server.stop(0)

    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    assert event_loop.run(main()) == [serving, not_serving, not_serving]
