"""Running a gRPC service: health, reflection, graceful SIGTERM; one place for every service.

Lifecycle: bind -> start -> health SERVING -> on_ready() -> wait for SIGTERM/SIGINT
-> health NOT_SERVING -> on_shutdown() (deregister) -> drain_s still accepting calls
-> server.stop(grace) lets in-flight calls finish -> return.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
from typing import Any, Awaitable, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from distserve import tracing

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


@dataclasses.dataclass
class Service:
    """One servicer to mount: `add(servicer, server)` is the generated add_*_to_server."""

    add: Callable[[Any, grpc.aio.Server], None]
    servicer: Any
    full_name: str  # e.g. "distserve.v1.RouterService", for health and reflection


async def run_grpc_server(
    address: str,
    services: list[Service],
    on_ready: Callable[[int], Awaitable[None]] | None = None,
    on_shutdown: Callable[[], Awaitable[None]] | None = None,
    grace_s: float = 30.0,
    stop_event: asyncio.Event | None = None,
    drain_s: float = 0.0,
) -> None:
    """Serves until SIGTERM/SIGINT (or stop_event). on_ready gets the bound port.

    After on_shutdown (deregistration) the server keeps accepting calls for drain_s, so requests
    routed to it just before it left the registry still land; then it stops taking new calls and
    lets in-flight ones finish for up to grace_s.
    """
    server = grpc.aio.server(options=CHANNEL_OPTIONS)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for service in services:
        service.add(service.servicer, server)
    names = [s.full_name for s in services]
    reflection.enable_server_reflection(
        names + [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
        server,
    )
    port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"could not bind gRPC server to {address}")
    await server.start()
    for name in ["", *names]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("serving %s on port %d", ",".join(names), port)
    stop = stop_event or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if on_ready:
        await on_ready(port)
    await stop.wait()
    log.info("shutting down")
    await health_servicer.enter_graceful_shutdown()
    if on_shutdown:
        await on_shutdown()
    if drain_s > 0:
        await asyncio.sleep(drain_s)
    await server.stop(grace_s)
    log.info("stopped")


class ChannelPool:
    """One channel per peer address, reused across calls; close() at shutdown."""

    def __init__(self) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}

    def get(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS,
                                                interceptors=tracing.client_interceptors())
            self._channels[address] = channel
        return channel

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close()
