"""A client that pings a distserve gRPC server more often than it allows is sent away (GOAWAY
too_many_pings) instead of being answered forever."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from distserve.grpc_server import SERVER_OPTIONS

PINGING_EVERY_200_MS = [("grpc.keepalive_time_ms", 200), ("grpc.keepalive_timeout_ms", 1000),
                        ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0)]


async def test_a_client_pinging_too_often_loses_its_connection():
    server = grpc.aio.server(options=SERVER_OPTIONS)
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        await servicer.set("svc", health_pb2.HealthCheckResponse.SERVING)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=PINGING_EVERY_200_MS) as channel:
            call = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service="svc"))
            assert (await call.read()).status == health_pb2.HealthCheckResponse.SERVING
            try:  # no data flows on the watch: only the client's pings, 3 strikes in about 3 s
                await asyncio.wait_for(call.read(), 15)
                raise AssertionError("the server answered instead of ending the pinging connection")
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAVAILABLE and "ping" in exc.details().lower()
    finally:
        await server.stop(0)
