"""decode worker settings."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from distserve.config import require, setting
from distserve.worker_config import WorkerConfig


@dataclasses.dataclass(frozen=True)
class DecodeConfig(WorkerConfig):
    """decode worker: generates tokens from transferred KV caches."""

    ROLE: ClassVar[str] = "decode"

    metrics_port: int = setting(9103, "port of the Prometheus /metrics endpoint (0: off)")
    port: int = setting(50080, "gRPC port")
    core_turns: str = setting("", "directory of the compute turns of the workers sharing these cores: each forward "
                                  "waits for its turn, turns alternate (empty: no turns, the cores are its own)")
    nice: int = setting(0, "lower this worker's CPU priority by this much (0-19): on cores lent to prefill "
                           "workers' forwards, theirs preempt its steps (for a worker started by hand; "
                           "distserve up --lend-cores lowers the children it starts itself)")
    broker_address: str = setting("127.0.0.1:50060", "kvbroker gRPC address; replicas comma-separated",
                                  env="DISTSERVE_BROKER_ADDRESS")
    block_size: int = setting(16, "tokens per KV block")
    kv_cache_mb: int = setting(1024, "memory for the paged KV cache, in MiB")
    max_running: int = setting(64, "most sequences in one decode batch")
    transfer_timeout_s: float = setting(30.0, "deadline for one KV transfer")
    admission_timeout_s: float = setting(30.0, "how long a request may wait for free KV blocks")
    reserve_ahead_tokens: int = setting(256, "KV blocks reserved on arrival cover the prompt and this many more "
                                             "tokens; the rest grow as decoding goes, and a sequence that finds "
                                             "the cache full preempts the youngest, which moves to another worker "
                                             "(0: reserve prompt + max_tokens up front)")
    max_waiting_for_blocks: int = setting(16, "requests that may wait for free KV blocks at once; more are refused "
                                              "at once with RESOURCE_EXHAUSTED (0: no bound)")
    also_colocated: bool = setting(False, "also serve whole requests (ColocatedService), prefilled here in the decode "
                                          "steps; the router sends them only while the prefill/decode pairs are "
                                          "saturated")
    max_batch_tokens: int = setting(0, "with also_colocated: prompt tokens of one step, the decoding sequences' "
                                       "rows on top (0: auto, the engine's measured saturation length)")
    rpc_timeout_s: float = setting(5.0, "deadline for calls to the kvbroker")

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.reserve_ahead_tokens >= 0, "reserve_ahead_tokens", "must be >= 0 (0: whole life up front)")
        require(self.max_waiting_for_blocks >= 0, "max_waiting_for_blocks", "must be >= 0 (0: no bound)")
        require(self.block_size > 0, "block_size", "must be > 0")
        require(self.kv_cache_mb > 0, "kv_cache_mb", "must be > 0")
        require(self.max_running > 0, "max_running", "must be > 0")
        require(0 <= self.nice <= 19, "nice", f"must be in [0, 19], got {self.nice}")
        require(not (self.also_colocated and self.core_turns), "also_colocated",
                "cannot be combined with core_turns (the colocated loop does not take turns)")
