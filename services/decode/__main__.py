"""python -m services.decode: run one decode worker."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import sys

import redis.asyncio as aioredis

from distserve import redis_client
from distserve.broker_client import BrokerClient
from distserve.config import parse_config
from distserve.cpus import apply_cpus, lower_priority
from distserve.engine.colocated_engine import ColocatedEngine
from distserve.engine.core_turns import core_turns
from distserve.engine.dtype import resolve_dtype
from distserve.engine.grammars import LazyGrammarCompiler
from distserve.engine.model_loader import load_engine_model, resolve_model_path
from distserve.engine.model_runner import ModelRunner
from distserve.model_spec import ModelSpec, load_model_spec
from distserve.grpc_server import ChannelPool, Service
from distserve.logs import setup_logging
from distserve.metrics import PREFIX, DecodeMetrics, serve_metrics, watch_prefix_cache
from distserve.tracing import init_tracing, shutdown_tracing
from distserve.worker_lifecycle import serve_worker
from distserve.registry import WorkerRecord, WorkerRegistry
from distserve.transfer import connector
from distserve.transfer.connector import KvConsumer
from distserve.prefix_events import attach_prefix_events
from distserve.v1 import decode_pb2_grpc
from services.colocated.build import also_colocated, build_prefill_side
from services.colocated.config import ColocatedConfig
from distserve.prefix_config import prefix_settings, shared_prefix
from services.decode.config import DecodeConfig
from distserve.engine.decode_engine import DecodeEngine, build_decode_engine
from distserve.engine.prefill_batcher import saturation_tokens
from services.decode.server import DecodeServicer

log = logging.getLogger(__name__)


def build_engine(config: DecodeConfig, model, spec: ModelSpec, grammars: LazyGrammarCompiler,
                 wakeup: asyncio.Event | None = None) -> DecodeEngine:
    runner = ModelRunner(model)
    runner.warm_up()
    return build_decode_engine(
        runner, spec, config.dtype, config.device, block_size=config.block_size, kv_cache_mb=config.kv_cache_mb,
        max_running=config.max_running, reserve_ahead_tokens=config.reserve_ahead_tokens, wakeup=wakeup,
        grammars=grammars, turns=core_turns(config.core_turns),
        prefix=shared_prefix(config, config.model, config.dtype, config.block_size),
        gpu_memory_fraction=config.gpu_memory_fraction,
        # with also_colocated, steps carry prompt chunks too, and the prefill half keeps a prefix cache there
        max_step_tokens=config.max_batch_tokens or (saturation_tokens(config.device) if config.also_colocated else 0),
        later_device_bytes=config.prefix_cache_mb * 2**20 if config.also_colocated and config.prefix_caching else 0)


async def preconnect(registry: WorkerRegistry, receiver: KvConsumer, interval_s: float) -> None:
    """Keeps UCX endpoints open to every registered prefill worker, so no request pays set-up."""
    while True:
        try:
            workers = await registry.list("prefill")
        except (aioredis.RedisError, OSError) as exc:
            log.warning("registry read failed: %s", exc)
            workers = []
        redis_client.raise_if_cancelled()
        for address in {w.ucx_address for w in workers} - receiver.peers:
            await receiver.connect(address)
        await asyncio.sleep(interval_s)


async def serve(config: DecodeConfig) -> None:
    path = resolve_model_path(config.model)
    model = load_engine_model(path, config.dtype, config.device)
    spec = load_model_spec(path)
    grammars = LazyGrammarCompiler(path, spec.vocab_size, spec.eos_token_ids)
    wakeup = asyncio.Event()  # shared with the prefill half when also_colocated
    engine = build_engine(config, model, spec, grammars, wakeup)
    metrics = DecodeMetrics()
    receiver = connector.make_consumer("ucx", config.advertise_host)
    redis = redis_client.connect(config.redis_url)
    registry = WorkerRegistry(redis, config.lease_s)
    channels = ChannelPool(config)
    servicer = DecodeServicer(config, spec, engine, receiver,
                              BrokerClient.over(channels, config.broker_address, config.rpc_timeout_s), metrics)
    serve_metrics(config.metrics_port, config.host)
    worker_id = config.resolved_worker_id

    def record() -> WorkerRecord:
        usage = engine.usage()
        load = {"num_running": usage.num_running, "num_waiting": usage.num_waiting,
                "free_blocks": usage.num_free_blocks, "total_blocks": usage.num_blocks,
                "block_size": config.block_size, "num_reserving": engine.num_reserving,
                "prefix_caching": int(config.prefix_caching),  # it keeps prompts' and answers' blocks
                "max_reserving": config.max_waiting_for_blocks}
        metrics.kv_usage.set(usage.num_used_blocks / usage.num_blocks)
        metrics.cached_blocks.set(usage.num_cached_blocks)
        metrics.running.set(usage.num_running)
        metrics.waiting.set(usage.num_waiting)
        return WorkerRecord(worker_id, "decode", f"{config.advertise_host}:{config.port}", "", load,
                            spec.kv_format(config.dtype))

    services = [Service(decode_pb2_grpc.add_DecodeServiceServicer_to_server, servicer, "distserve.v1.DecodeService",
                        on_stop=servicer.drain_sessions)]
    records, loop = [record], engine.run
    if config.also_colocated:  # a prefill half over the same runner; one loop drives both halves
        colocated_config = ColocatedConfig(
            **prefix_settings(config), worker_id=worker_id, model=config.model, dtype=config.dtype,
            device=config.device, max_batch_tokens=config.max_batch_tokens,
            block_size=config.block_size, max_running=config.max_running,
            admission_timeout_s=config.admission_timeout_s, max_waiting_for_blocks=config.max_waiting_for_blocks)
        colocated = ColocatedEngine(build_prefill_side(colocated_config, engine.runner, spec, grammars, wakeup),
                                    engine, wakeup)
        watch_prefix_cache(colocated.prefill.prefix_cache, PREFIX + "colocated_")
        service, spill_record = also_colocated(colocated_config, spec, colocated,
                                               f"{config.advertise_host}:{config.port}")
        services.append(service)
        records.append(spill_record)
        loop = colocated.run
    publish_events = attach_prefix_events(
        redis, worker_id, colocated.prefill.prefix_cache if config.also_colocated else None, engine.shared_blocks)
    log.info("decode worker %s: blocks=%d model=%s%s", worker_id, engine.usage().num_blocks, path,
             " (also colocated)" if config.also_colocated else "")
    try:
        await serve_worker(f"{config.host}:{config.port}", services, registry, records, config.heartbeat_s,
                           [loop, lambda: preconnect(registry, receiver, config.heartbeat_s),
                            *publish_events],
                           config.grace_s, config.drain_s, tls=config,
                           max_concurrent_streams=config.max_concurrent_streams)
    finally:
        await receiver.close()
        connector.shutdown("ucx")
        await channels.close()
        await redis.aclose()
        shutdown_tracing()


def _lower_priority(nice: int) -> None:
    if not nice:
        return
    problem = lower_priority(nice)
    if problem:
        log.warning("could not lower this session's CPU priority (threads are lowered): %s", problem)
    log.info("CPU priority lowered by %d (nice %d)", nice, os.getpriority(os.PRIO_PROCESS, 0))


def main(argv: list[str] | None = None) -> None:
    setup_logging("decode")
    config = parse_config(DecodeConfig, argv, prefix="DISTSERVE_DECODE_")
    _lower_priority(config.nice)  # before the threads start: they inherit it
    init_tracing("distserve-decode")
    apply_cpus(config.cpus, config.serving_cpus)  # before torch does parallel work
    config = dataclasses.replace(config, dtype=resolve_dtype(config.dtype, config.device))
    asyncio.run(serve(config))


if __name__ == "__main__":
    sys.exit(main())
