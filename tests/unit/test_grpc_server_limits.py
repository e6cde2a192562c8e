"""distserve.grpc_server.run_grpc_server: a client connection has at most max_concurrent_streams calls
open (a call past it waits for a slot), and a Drain call stops the server as SIGTERM does."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from distserve.config import ConfigError
from distserve.grpc_server import run_grpc_server
from distserve.launcher import free_port
from distserve.v1 import lifecycle_pb2, lifecycle_pb2_grpc


async def test_calls_past_the_stream_cap_wait_for_a_slot_and_drain_stops_the_server():
    port = free_port()
    stopped = []

    async def on_shutdown():
        stopped.append(True)

    server = asyncio.ensure_future(run_grpc_server(f"127.0.0.1:{port}", [], on_shutdown=on_shutdown, grace_s=1,
                                                   max_concurrent_streams=2))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        await channel.channel_ready()
        health = health_pb2_grpc.HealthStub(channel)
        watches = [health.Watch(health_pb2.HealthCheckRequest()) for _ in range(2)]  # open until cancelled
        for watch in watches:
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.aio.AioRpcError) as waited:
            await health.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
        assert waited.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED  # queued behind the two
        watches[0].cancel()
        assert (await health.Check(health_pb2.HealthCheckRequest(), timeout=5.0)).status == \
            health_pb2.HealthCheckResponse.SERVING
        watches[1].cancel()
        reply = await lifecycle_pb2_grpc.LifecycleServiceStub(channel).Drain(lifecycle_pb2.DrainRequest(), timeout=5)
        assert not reply.already_draining
    await asyncio.wait_for(server, 10)
    assert stopped == [True]


async def test_a_stream_cap_under_one_is_a_config_error():
    with pytest.raises(ConfigError, match="max_concurrent_streams"):
        await run_grpc_server(f"127.0.0.1:{free_port()}", [], max_concurrent_streams=0)
