"""python -m services.router: run the router."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from pathlib import Path


from distserve import event_loop, redis_client
from distserve.bearer_key import BearerKeyInterceptor
from distserve.config import parse_config
from distserve.engine.model_loader import load_tokenizer, resolve_model_path
from distserve.model_spec import load_model_spec
from distserve.grpc_server import ChannelPool, Service, run_grpc_server
from distserve.logs import setup_logging
from distserve.metrics import RouterMetrics, serve_metrics
from distserve.tracing import init_tracing, shutdown_tracing
from distserve.registry import WorkerRegistry
from distserve.v1 import router_pb2_grpc
from distserve.prefix_events import follow_prefix_events
from services.router.config import RouterConfig
from distserve.spill_policy import SpillPolicy
from services.router.grammar_check import GrammarChecker
from services.router.picker import WorkerPicker
from services.router.server import RouterServicer

log = logging.getLogger(__name__)


async def serve(config: RouterConfig) -> None:
    path = resolve_model_path(config.model)
    redis = redis_client.connect(config.redis_url)
    events_redis = redis_client.connect(config.redis_url)
    picker = WorkerPicker(WorkerRegistry(redis, lease_s=0), config.suspect_s,
                          SpillPolicy(config.spill_prefill_tokens, config.spill_decode_running,
                                      config.spill_burst_tokens))
    channels = ChannelPool(config)
    spec = load_model_spec(path)
    grammars = GrammarChecker(path, spec.vocab_size, spec.eos_token_ids, config.grammar_compile_timeout_s,
                              cpu_share=config.grammar_compile_cpu_share)
    servicer = RouterServicer(config, load_tokenizer(path), spec, picker, channels, grammars,
                              model_name=Path(path).name, metrics=RouterMetrics())
    serve_metrics(config.metrics_port, config.host)
    tasks: list[asyncio.Task] = []

    async def on_ready(port: int) -> None:
        tasks.append(asyncio.create_task(picker.run_refresh(config.registry_refresh_s)))
        if config.prefix_events:  # its own connection: a blocking read holds the one it uses
            tasks.append(asyncio.create_task(follow_prefix_events(events_redis, picker.apply_prefix_event)))
        log.info("router ready: grpc=%s model=%s", port, path)

    service = Service(router_pb2_grpc.add_RouterServiceServicer_to_server, servicer, "distserve.v1.RouterService",
                      on_stop=servicer.drain_sessions)
    try:
        await run_grpc_server(f"{config.host}:{config.port}", [service], on_ready, tls=config,
                              max_receive_bytes=int(config.max_request_mb * 2**20),
                              max_concurrent_streams=config.max_concurrent_streams,
                              interceptors=[BearerKeyInterceptor(config.api_key)] if config.api_key else [])
    finally:
        for task in tasks:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*tasks, return_exceptions=True)
        await servicer.close()
        await channels.close()
        await grammars.close()
        await redis.aclose()
        await events_redis.aclose()
        shutdown_tracing()


def main(argv: list[str] | None = None) -> None:
    setup_logging("router")
    init_tracing("distserve-router")
    config = parse_config(RouterConfig, argv, prefix="DISTSERVE_ROUTER_").with_api_key_from_file()
    event_loop.run(serve(config))


if __name__ == "__main__":
    sys.exit(main())
