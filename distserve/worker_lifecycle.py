"""The lifecycle every worker shares: serve gRPC, run background loops, stay registered.

ready   -> start the worker's loops and the registry heartbeat
SIGTERM -> stop heartbeats, deregister, keep serving for drain_s, finish in-flight calls (grace_s)
exit    -> cancel the loops
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

from distserve.grpc_server import MAX_CONCURRENT_STREAMS, PLAINTEXT, Service, TlsConfig, run_grpc_server
from distserve.peer_roles import WORKER_CALLERS
from distserve.registry import WorkerRecord, WorkerRegistry, heartbeat

log = logging.getLogger(__name__)


async def serve_worker(
    address: str,
    services: list[Service],
    registry: WorkerRegistry,
    make_records: list[Callable[[], WorkerRecord]],
    heartbeat_s: float,
    loops: list[Callable[[], Awaitable[None]]],
    grace_s: float,
    drain_s: float,
    tls: TlsConfig = PLAINTEXT,
    max_concurrent_streams: int = MAX_CONCURRENT_STREAMS,
) -> None:
    """Serves until SIGTERM; `loops` are started once the server is up and cancelled at exit. Each of
    `make_records` is one registry entry (a worker serving two roles has two), heartbeated on its own."""
    tasks: list[asyncio.Task] = []
    beat: list[asyncio.Task] = []
    stop_beating = asyncio.Event()

    async def on_ready(port: int) -> None:
        tasks.extend(asyncio.create_task(loop()) for loop in loops)
        beat.extend(asyncio.create_task(heartbeat(registry, make, heartbeat_s, stop_beating)) for make in make_records)
        for record in (make() for make in make_records):
            log.info("%s worker %s ready on port %d", record.role, record.worker_id, port)

    async def on_shutdown() -> None:
        stop_beating.set()
        await asyncio.gather(*beat)  # no heartbeat in flight may re-register the worker after this
        for record in (make() for make in make_records):
            await registry.remove(record.role, record.worker_id)

    try:
        await run_grpc_server(address, services, on_ready, on_shutdown, grace_s=grace_s, drain_s=drain_s,
                              tls=tls, peer_roles=WORKER_CALLERS, max_concurrent_streams=max_concurrent_streams)
    finally:
        await stop_tasks(tasks + beat)


async def stop_tasks(tasks: list[asyncio.Task], rounds: int = 10, round_s: float = 1.0) -> None:
    """Cancels tasks and waits for them, cancelling again each round: a library call that swallows
    one cancellation (seen with a UCX connect to a dead peer) must not keep the process alive."""
    pending = {t for t in tasks if not t.done()}
    for _ in range(rounds):
        if not pending:
            return
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=round_s)
    log.error("background tasks still running at exit: %s", [t.get_coro() for t in pending])
