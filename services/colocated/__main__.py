"""python -m services.colocated: run one colocated (prefill + decode) worker."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import sys


from distserve import redis_client
from distserve.config import parse_config
from distserve.cpus import apply_cpus
from distserve.engine.colocated_engine import ColocatedEngine
from distserve.engine.dtype import resolve_dtype
from distserve.engine.grammars import LazyGrammarCompiler
from distserve.engine.model_loader import load_engine_model, resolve_model_path
from distserve.engine.model_runner import ModelRunner
from distserve.model_spec import ModelSpec, load_model_spec
from distserve.grpc_server import Service
from distserve.logs import setup_logging
from distserve.metrics import ColocatedMetrics, serve_metrics, watch_prefix_cache
from distserve.registry import WorkerRecord, WorkerRegistry
from distserve.tracing import init_tracing, shutdown_tracing
from distserve.v1 import colocated_pb2_grpc
from distserve.worker_lifecycle import serve_worker
from distserve.prefix_events import attach_prefix_events
from services.colocated.build import build_decode_side, build_prefill_side, colocated_load
from services.colocated.config import ColocatedConfig
from services.colocated.server import ColocatedServicer

log = logging.getLogger(__name__)


def build_engine(config: ColocatedConfig, model, spec: ModelSpec, grammars: LazyGrammarCompiler) -> ColocatedEngine:
    """A prefill batcher and a decode engine over one runner and one paged cache, driven by one loop."""
    runner = ModelRunner(model)
    runner.warm_up()
    wakeup = asyncio.Event()
    return ColocatedEngine(build_prefill_side(config, runner, spec, grammars, wakeup),
                           build_decode_side(config, runner, spec, grammars, wakeup), wakeup)


async def serve(config: ColocatedConfig) -> None:
    path = resolve_model_path(config.model)
    spec = load_model_spec(path)
    engine = build_engine(config, load_engine_model(path, config.dtype, config.device), spec,
                          LazyGrammarCompiler(path, spec.vocab_size, spec.eos_token_ids))
    metrics = ColocatedMetrics()
    watch_prefix_cache(engine.prefill.prefix_cache)
    redis = redis_client.connect(config.redis_url)
    registry = WorkerRegistry(redis, config.lease_s)
    servicer = ColocatedServicer(config, spec, engine, metrics)
    serve_metrics(config.metrics_port, config.host)
    worker_id = config.resolved_worker_id
    publish_events = attach_prefix_events(redis, worker_id, engine.prefill.prefix_cache, engine.decode.shared_blocks)

    def record() -> WorkerRecord:
        usage = engine.decode.usage()
        metrics.kv_usage.set(usage.num_used_blocks / usage.num_blocks)
        metrics.running.set(usage.num_running)
        metrics.waiting.set(engine.prefill.num_waiting)
        return WorkerRecord(worker_id, "colocated", f"{config.advertise_host}:{config.port}", "",
                            colocated_load(engine, config.block_size), spec.kv_format(config.dtype))

    service = Service(colocated_pb2_grpc.add_ColocatedServiceServicer_to_server, servicer,
                      "distserve.v1.ColocatedService", on_stop=servicer.drain_sessions)
    log.info("colocated worker %s: blocks=%d max_batch_tokens=%d model=%s", worker_id,
             engine.decode.usage().num_blocks, engine.max_batch_tokens, path)
    try:
        await serve_worker(f"{config.host}:{config.port}", [service], registry, [record], config.heartbeat_s,
                           [engine.run, *publish_events], config.grace_s, config.drain_s, tls=config,
                           max_concurrent_streams=config.max_concurrent_streams)
    finally:
        await redis.aclose()
        shutdown_tracing()


def main(argv: list[str] | None = None) -> None:
    setup_logging("colocated")
    init_tracing("distserve-colocated")
    config = parse_config(ColocatedConfig, argv, prefix="DISTSERVE_COLOCATED_")
    apply_cpus(config.cpus, config.serving_cpus)  # before torch does parallel work
    config = dataclasses.replace(config, dtype=resolve_dtype(config.dtype, config.device))
    asyncio.run(serve(config))


if __name__ == "__main__":
    sys.exit(main())
