"""colocated worker settings."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from distserve.config import require, setting
from distserve.worker_config import WorkerConfig


@dataclasses.dataclass(frozen=True)
class ColocatedConfig(WorkerConfig):
    """colocated worker: prefills and decodes whole requests with one engine."""

    ROLE: ClassVar[str] = "colocated"

    metrics_port: int = setting(9104, "port of the Prometheus /metrics endpoint (0: off)")
    port: int = setting(50090, "gRPC port")
    max_batch_tokens: int = setting(0, "prompt tokens of one step, the decoding sequences' rows (one each) on top "
                                       "(0: auto, the engine's measured saturation length for the device)")
    block_size: int = setting(16, "tokens per KV block")
    kv_cache_mb: int = setting(1024, "memory for the paged KV cache, in MiB")
    max_running: int = setting(64, "most sequences decoding at once")
    admission_timeout_s: float = setting(30.0, "how long a prefilled request may wait for free KV blocks")
    max_waiting_for_blocks: int = setting(16, "requests that may wait for free KV blocks at once; more are refused "
                                              "at once with RESOURCE_EXHAUSTED (0: no bound)")

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.max_waiting_for_blocks >= 0, "max_waiting_for_blocks", "must be >= 0 (0: no bound)")
        require(self.block_size > 0, "block_size", "must be > 0")
        require(self.kv_cache_mb > 0, "kv_cache_mb", "must be > 0")
        require(self.max_running > 0, "max_running", "must be > 0")
