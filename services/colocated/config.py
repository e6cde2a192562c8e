"""colocated worker settings."""

from __future__ import annotations

import dataclasses

from distserve.config import require, setting
from distserve.grpc_server import TlsConfig
from distserve.cpus import parse_cpu_list
from distserve.engine.dtype import DTYPE_CHOICES
from distserve.prefix_config import PrefixCacheConfig


@dataclasses.dataclass(frozen=True)
class ColocatedConfig(PrefixCacheConfig, TlsConfig):
    """colocated worker: prefills and decodes whole requests with one engine."""

    host: str = setting("127.0.0.1", "interface to bind the gRPC server to")
    metrics_port: int = setting(9104, "port of the Prometheus /metrics endpoint (0: off)")
    port: int = setting(50090, "gRPC port")
    advertise_host: str = setting("127.0.0.1", "host other services use to reach this worker")
    worker_id: str = setting("", "unique worker id (default: colocated-<host>-<port>)")
    model: str = setting("default", "HF model folder, or default[:small|tiny]", env="DISTSERVE_MODEL")
    dtype: str = setting("auto", "model dtype; auto: bfloat16 on CUDA or on CPUs with bf16 instructions, "
                         "else float32", env="DISTSERVE_DTYPE")
    device: str = setting("cpu", "torch device", env="DISTSERVE_DEVICE")
    cpus: str = setting("", "cores to pin this worker to, e.g. 0 or 2-3 (empty: all cores the process may use)")
    serving_cpus: str = setting("", "cores for the serving threads (event loop, gRPC, KV transfers), e.g. 0-1; "
                                    "forwards stay on cpus (empty: the same cores as cpus)")
    redis_url: str = setting("redis://127.0.0.1:6379/0", "registry Redis", env="DISTSERVE_REDIS_URL")
    max_batch_tokens: int = setting(0, "prompt tokens of one step, the decoding sequences' rows (one each) on top "
                                       "(0: auto, the engine's measured saturation length for the device)")
    block_size: int = setting(16, "tokens per KV block")
    kv_cache_mb: int = setting(1024, "memory for the paged KV cache, in MiB")
    max_running: int = setting(64, "most sequences decoding at once")
    admission_timeout_s: float = setting(30.0, "how long a prefilled request may wait for free KV blocks")
    max_waiting_for_blocks: int = setting(16, "requests that may wait for free KV blocks at once; more are refused "
                                              "at once with RESOURCE_EXHAUSTED (0: no bound)")
    heartbeat_s: float = setting(1.0, "registry heartbeat interval")
    lease_s: float = setting(3.0, "registry lease: the worker vanishes this long after its last heartbeat")
    drain_s: float = setting(2.0, "on SIGTERM, keep accepting calls this long after deregistering")
    grace_s: float = setting(60.0, "on SIGTERM, then let in-flight calls finish for up to this long")

    def __post_init__(self) -> None:
        self.check_prefix_cache()
        require(0 <= self.port < 65536, "port", f"must be in [0, 65535], got {self.port}")
        require(self.dtype in DTYPE_CHOICES, "dtype", f"must be one of {list(DTYPE_CHOICES)}, got {self.dtype!r}")
        if self.cpus:
            parse_cpu_list(self.cpus)  # raises ConfigError naming cpus
        if self.serving_cpus:
            parse_cpu_list(self.serving_cpus, "serving_cpus")
        require(self.max_batch_tokens >= 0, "max_batch_tokens", "must be >= 0 (0: auto)")
        require(self.max_waiting_for_blocks >= 0, "max_waiting_for_blocks", "must be >= 0 (0: no bound)")
        require(self.block_size > 0, "block_size", "must be > 0")
        require(self.kv_cache_mb > 0, "kv_cache_mb", "must be > 0")
        require(self.max_running > 0, "max_running", "must be > 0")
        require(0 < self.heartbeat_s < self.lease_s, "heartbeat_s", "must be > 0 and below lease_s")

    @property
    def resolved_worker_id(self) -> str:
        return self.worker_id or f"colocated-{self.advertise_host}-{self.port}"
