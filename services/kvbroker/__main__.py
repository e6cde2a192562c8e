"""python -m services.kvbroker: run the kvbroker."""

from __future__ import annotations

import asyncio
import sys


from distserve import redis_client
from distserve.config import parse_config
from distserve.grpc_server import Service, run_grpc_server
from distserve.peer_roles import BROKER_CALLERS
from distserve.logs import setup_logging
from distserve.metrics import BrokerMetrics, serve_metrics
from distserve.tracing import init_tracing, shutdown_tracing
from distserve.v1 import kvbroker_pb2_grpc
from services.kvbroker.config import KvBrokerConfig
from services.kvbroker.server import KvBrokerServicer
from services.kvbroker.store import HandleStore


async def serve(config: KvBrokerConfig) -> None:
    redis = redis_client.connect(config.redis_url)
    servicer = KvBrokerServicer(HandleStore(redis), config, BrokerMetrics())
    serve_metrics(config.metrics_port, config.host)
    service = Service(kvbroker_pb2_grpc.add_KvBrokerServiceServicer_to_server, servicer,
                      "distserve.v1.KvBrokerService")
    try:
        await run_grpc_server(f"{config.host}:{config.port}", [service], tls=config, peer_roles=BROKER_CALLERS,
                              max_concurrent_streams=config.max_concurrent_streams)
    finally:
        await redis.aclose()
        shutdown_tracing()


def main(argv: list[str] | None = None) -> None:
    setup_logging("kvbroker")
    init_tracing("distserve-kvbroker")
    config = parse_config(KvBrokerConfig, argv, prefix="DISTSERVE_KVBROKER_")
    asyncio.run(serve(config))


if __name__ == "__main__":
    sys.exit(main())
