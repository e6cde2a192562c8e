"""Building a colocated engine, whole or around a prefill or decode worker's own engine half.

A prefill or decode worker started with `also_colocated` serves whole requests too (ColocatedService,
beside its own): its engine half gets the other half over the same runner, and one ColocatedEngine
loop drives both. It registers a second record, role "colocated" with `spill_only` set: the router
sends it whole requests only while the prefill/decode pairs are saturated (services.router.picker).
"""

from __future__ import annotations

import asyncio
from typing import Callable

from distserve.engine.colocated_engine import ColocatedEngine
from distserve.engine.decode_engine import DecodeEngine, build_decode_engine
from distserve.engine.grammars import LazyGrammarCompiler
from distserve.engine.model_runner import ModelRunner
from distserve.model_spec import ModelSpec
from distserve.engine.prefill_batcher import PrefillBatcher, saturation_tokens
from distserve.engine.prefix_cache import build_prefix_cache
from distserve.prefix_config import shared_prefix
from distserve.grpc_server import Service
from distserve.metrics import PREFIX, ColocatedMetrics
from distserve.registry import WorkerRecord
from distserve.v1 import colocated_pb2_grpc
from services.colocated.config import ColocatedConfig
from services.colocated.server import ColocatedServicer


def build_prefill_side(config: ColocatedConfig, runner: ModelRunner, spec: ModelSpec,
                       grammars: LazyGrammarCompiler, wakeup: asyncio.Event) -> PrefillBatcher:
    return PrefillBatcher(runner, spec.eos_token_ids, spec.max_context,
                          config.max_batch_tokens or saturation_tokens(config.device), wakeup, grammars=grammars,
                          prefix_cache=build_prefix_cache(config, config.model, spec, config.dtype, config.device))


def build_decode_side(config: ColocatedConfig, runner: ModelRunner, spec: ModelSpec,
                      grammars: LazyGrammarCompiler, wakeup: asyncio.Event) -> DecodeEngine:
    """A decode engine with its own paged cache of config.kv_cache_mb; every sequence reserves its
    whole life on arrival (no reserve-ahead), so none is ever preempted."""
    return build_decode_engine(runner, spec, config.dtype, config.device, block_size=config.block_size,
                               kv_cache_mb=config.kv_cache_mb, max_running=config.max_running, wakeup=wakeup,
                               grammars=grammars,
                               prefix=shared_prefix(config, config.model, config.dtype, config.block_size),
                               gpu_memory_fraction=config.gpu_memory_fraction,
                               # the prefill side, built first, holds its prefix cache already
                               max_step_tokens=config.max_batch_tokens or saturation_tokens(config.device))


def colocated_load(engine: ColocatedEngine, block_size: int) -> dict[str, float]:
    """What the router compares across colocated workers and prefill/decode pairs: queued prompt tokens
    and decode tokens, and what each costs this worker (seconds per token, 0 until measured)."""
    prefill, decode = engine.prefill, engine.decode
    usage = decode.usage()
    return {"outstanding_tokens": prefill.outstanding_tokens, "num_waiting": prefill.num_waiting,
            "num_running": usage.num_running, "free_blocks": usage.num_free_blocks,
            "total_blocks": usage.num_blocks, "block_size": block_size,
            "decode_tokens_left": decode.tokens_left, "prefill_s_per_token": prefill.cost.per_unit,
            "decode_s_per_token": decode.cost.per_unit,
            "prefix_caching": int(decode.shared_blocks is not None),  # its paged cache keeps prompts and answers
            **prefill.prefix_load()}


def also_colocated(config: ColocatedConfig, spec: ModelSpec, engine: ColocatedEngine,
                   advertise: str) -> tuple[Service, Callable[[], WorkerRecord]]:
    """The ColocatedService of a prefill or decode worker over `engine`, and its spill-only record
    (same worker id, role colocated; `advertise` is the worker's host:port)."""
    servicer = ColocatedServicer(config, spec, engine, ColocatedMetrics(PREFIX + "colocated_"))
    service = Service(colocated_pb2_grpc.add_ColocatedServiceServicer_to_server, servicer,
                      "distserve.v1.ColocatedService", on_stop=servicer.drain_sessions)

    def record() -> WorkerRecord:
        load = {**colocated_load(engine, config.block_size), "spill_only": 1}
        return WorkerRecord(config.resolved_worker_id, "colocated", advertise, "", load, spec.kv_format(config.dtype))

    return service, record
