"""python -m services.prefill: run one prefill worker."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import sys

import redis.asyncio as aioredis

from distserve import redis_client
from distserve.broker_client import BrokerClient
from distserve.config import parse_config
from distserve.cpus import apply_cpus
from distserve.engine.colocated_engine import ColocatedEngine
from distserve.engine.core_turns import core_turns
from distserve.engine.dtype import resolve_dtype
from distserve.engine.grammars import LazyGrammarCompiler
from distserve.engine.model_loader import load_engine_model, resolve_model_path
from distserve.engine.model_runner import ModelRunner
from distserve.model_spec import load_model_spec
from distserve.grpc_server import ChannelPool, Service
from distserve.logs import setup_logging
from distserve.metrics import PrefillMetrics, serve_metrics, watch_prefix_cache
from distserve.tracing import init_tracing, shutdown_tracing
from distserve.worker_lifecycle import serve_worker
from distserve.registry import WorkerRecord, WorkerRegistry
from distserve.transfer.kv_peers import PEER_ROLES, KvPeerPolicy, host_of
from distserve.transfer import connector
from distserve.prefix_events import attach_prefix_events
from distserve.v1 import prefill_pb2_grpc
from services.kvbroker.store import release_channel
from distserve.engine.prefill_batcher import PrefillBatcher, saturation_tokens
from distserve.engine.prefix_cache import build_prefix_cache
from distserve.prefix_config import prefix_settings
from services.colocated.build import also_colocated, build_decode_side
from services.colocated.config import ColocatedConfig
from services.prefill.config import PrefillConfig
from services.prefill.held_kv import HeldKv
from services.prefill.server import PrefillServicer

log = logging.getLogger(__name__)


async def follow_releases(redis: aioredis.Redis, worker_id: str, held: HeldKv) -> None:
    """Frees held KV when the broker announces its release (decode done, or cancelled).

    Resubscribes after a Redis outage; buffers released meanwhile are freed by their lease.
    """
    while True:
        try:
            async with redis.pubsub() as pubsub:
                await pubsub.subscribe(release_channel(worker_id))
                async for message in pubsub.listen():
                    redis_client.raise_if_cancelled()
                    if message["type"] == "message":
                        held.free(message["data"].decode())
        except (aioredis.RedisError, OSError) as exc:
            log.warning("release subscription lost (%s); resubscribing", exc)
            redis_client.raise_if_cancelled()
            await asyncio.sleep(1.0)


async def kv_peer_policy(config: PrefillConfig, registry: WorkerRegistry) -> KvPeerPolicy | None:
    """Who may connect to pull KV (config.kv_peers): None when anyone may."""
    if config.kv_peers == "any":
        return None

    async def list_peer_hosts() -> set[str]:
        return {host_of(record.address) for role in PEER_ROLES for record in await registry.list(role)}

    return await KvPeerPolicy.for_worker(config.advertise_host, list_peer_hosts)


async def serve(config: PrefillConfig) -> None:
    path = resolve_model_path(config.model)
    model = load_engine_model(path, config.dtype, config.device)
    spec = load_model_spec(path)
    runner = ModelRunner(model)
    runner.warm_up()
    batch_tokens = config.max_batch_tokens or saturation_tokens(config.device)
    grammars = LazyGrammarCompiler(path, spec.vocab_size, spec.eos_token_ids)
    wakeup = asyncio.Event()  # shared with the decode half when also_colocated
    batcher = PrefillBatcher(runner, spec.eos_token_ids, spec.max_context, batch_tokens, wakeup,
                             max_queued_tokens=config.max_queued_tokens or 256 * batch_tokens,
                             queue_timeout_s=config.queue_timeout_s,
                             grammars=grammars, turns=core_turns(config.core_turns),
                             prefix_cache=build_prefix_cache(config, config.model, spec, config.dtype, config.device))
    held = HeldKv(config.resolved_max_held_kv_bytes)
    metrics = PrefillMetrics()
    watch_prefix_cache(batcher.prefix_cache)

    def on_sent(handle_id: str, num_bytes: int, seconds: float) -> None:
        held.free(handle_id)
        metrics.kv_transfer_bytes.inc(num_bytes)
        metrics.kv_transfer_time.observe(seconds)

    redis = redis_client.connect(config.redis_url)
    registry = WorkerRegistry(redis, config.lease_s)
    peers = await kv_peer_policy(config, registry)
    sender = connector.make_producer("ucx", held.lookup, on_sent, held.admits, peers and peers.admits)
    ucx_address = f"{config.advertise_host}:{sender.start(config.ucx_port, config.advertise_host)}"
    channels = ChannelPool(config)
    servicer = PrefillServicer(config, spec, config.dtype, batcher, held, sender,
                               BrokerClient.over(channels, config.broker_address, config.rpc_timeout_s),
                               ucx_address, metrics)
    serve_metrics(config.metrics_port, config.host)
    worker_id = config.resolved_worker_id

    def record() -> WorkerRecord:
        load = {"outstanding_tokens": batcher.outstanding_tokens, "num_waiting": batcher.num_waiting,
                "held_bytes": held.num_bytes, "max_held_bytes": held.max_bytes,
                "max_queued_tokens": batcher.max_queued_tokens, **batcher.prefix_load()}
        metrics.waiting.set(batcher.num_waiting)
        metrics.queued_tokens.set(batcher.outstanding_tokens)
        metrics.running.set(batcher.num_running)
        metrics.held_bytes.set(held.num_bytes)
        return WorkerRecord(worker_id, "prefill", f"{config.advertise_host}:{config.port}", ucx_address, load,
                            spec.kv_format(config.dtype))

    services = [Service(prefill_pb2_grpc.add_PrefillServiceServicer_to_server, servicer,
                        "distserve.v1.PrefillService")]
    records, loop = [record], batcher.run
    if config.also_colocated:  # a decode half over the same runner; one loop drives both halves
        colocated_config = ColocatedConfig(**prefix_settings(config), worker_id=worker_id, dtype=config.dtype,
                                           model=config.model, device=config.device,
                                           max_batch_tokens=batch_tokens, kv_cache_mb=config.colocated_kv_cache_mb)
        engine = ColocatedEngine(batcher, build_decode_side(colocated_config, runner, spec, grammars, wakeup),
                                 wakeup)
        service, spill_record = also_colocated(colocated_config, spec, engine, f"{config.advertise_host}:{config.port}")
        services.append(service)
        records.append(spill_record)
        loop = engine.run
    publish_events = attach_prefix_events(redis, worker_id, batcher.prefix_cache,
                                          engine.decode.shared_blocks if config.also_colocated else None)
    log.info("prefill worker %s: ucx=%s model=%s%s", worker_id, ucx_address, path,
             " (also colocated)" if config.also_colocated else "")
    try:
        await serve_worker(f"{config.host}:{config.port}", services, registry, records, config.heartbeat_s,
                           [loop, held.run_expiry, lambda: follow_releases(redis, worker_id, held),
                            *publish_events],
                           config.grace_s, config.drain_s, tls=config,
                           max_concurrent_streams=config.max_concurrent_streams)
    finally:
        sender.stop()
        connector.shutdown("ucx")
        await channels.close()
        await redis.aclose()
        shutdown_tracing()


def main(argv: list[str] | None = None) -> None:
    setup_logging("prefill")
    init_tracing("distserve-prefill")
    config = parse_config(PrefillConfig, argv, prefix="DISTSERVE_PREFILL_")
    apply_cpus(config.cpus, config.serving_cpus)  # before torch does parallel work
    config = dataclasses.replace(config, dtype=resolve_dtype(config.dtype, config.device))
    asyncio.run(serve(config))


if __name__ == "__main__":
    sys.exit(main())
