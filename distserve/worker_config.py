"""The settings every model worker has (prefill, decode, colocated): where it listens and registers,
which model in which dtype on which device and cores, its batch limit, its registry lease and how it
shuts down, with the prefix cache's and TLS settings. Each worker's config adds its own fields and
redeclares those whose defaults are its own (ports, the batch limit's help)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from distserve.config import require, setting
from distserve.cpus import parse_cpu_list
from distserve.engine.default_model import MODEL_HELP
from distserve.engine.dtype import DTYPE_CHOICES
from distserve.grpc_server import GrpcServerConfig
from distserve.prefix_config import PrefixCacheConfig


@dataclasses.dataclass(frozen=True)
class WorkerConfig(PrefixCacheConfig, GrpcServerConfig):
    ROLE: ClassVar[str] = "worker"  # names the default worker id: <role>-<advertise_host>-<port>

    host: str = setting("127.0.0.1", "interface to bind the gRPC server to")
    metrics_port: int = setting(0, "port of the Prometheus /metrics endpoint (0: off)")
    port: int = setting(0, "gRPC port")
    advertise_host: str = setting("127.0.0.1", "host other services use to reach this worker")
    worker_id: str = setting("", "unique worker id (default: <role>-<advertise_host>-<port>)")
    model: str = setting("default", MODEL_HELP, env="DISTSERVE_MODEL")
    dtype: str = setting("auto", "model dtype; auto: bfloat16 on CUDA or on CPUs with bf16 instructions, "
                         "else float32", env="DISTSERVE_DTYPE")
    device: str = setting("cpu", "torch device", env="DISTSERVE_DEVICE")
    gpu_memory_fraction: float = setting(0.0, "on CUDA: the fraction of the GPU's memory this worker may use; its "
                                              "paged KV cache gets what the weights and one step's activations "
                                              "leave (0: kv_cache_mb)", env="DISTSERVE_GPU_MEMORY_FRACTION")
    cpus: str = setting("", "cores to pin this worker to, e.g. 0 or 2-3 (empty: all cores the process may use)")
    serving_cpus: str = setting("", "cores for the serving threads (event loop, gRPC, KV transfers), e.g. 0-1; "
                                    "forwards stay on cpus (empty: the same cores as cpus)")
    redis_url: str = setting("redis://127.0.0.1:6379/0", "registry Redis", env="DISTSERVE_REDIS_URL")
    max_batch_tokens: int = setting(0, "prompt tokens of one forward (0: auto, the engine's measured saturation "
                                       "length for the device)")
    heartbeat_s: float = setting(1.0, "registry heartbeat interval")
    lease_s: float = setting(3.0, "registry lease: the worker vanishes this long after its last heartbeat")
    drain_s: float = setting(2.0, "on SIGTERM, keep accepting calls this long after deregistering")
    grace_s: float = setting(60.0, "on SIGTERM, then let in-flight calls finish for up to this long")

    def __post_init__(self) -> None:
        """Checks the shared fields; a subclass's __post_init__ calls this first, then checks its own."""
        super().__post_init__()
        self.check_prefix_cache()
        require(0 <= self.port < 65536, "port", f"must be in [0, 65535], got {self.port}")
        require(self.dtype in DTYPE_CHOICES, "dtype", f"must be one of {list(DTYPE_CHOICES)}, got {self.dtype!r}")
        if self.cpus:
            parse_cpu_list(self.cpus)  # raises ConfigError naming cpus
        if self.serving_cpus:
            parse_cpu_list(self.serving_cpus, "serving_cpus")
        require(self.max_batch_tokens >= 0, "max_batch_tokens", "must be >= 0 (0: auto)")
        require(0 <= self.gpu_memory_fraction <= 1, "gpu_memory_fraction",
                f"must be in [0, 1] (0: kv_cache_mb), got {self.gpu_memory_fraction}")
        require(0 < self.heartbeat_s < self.lease_s, "heartbeat_s", "must be > 0 and below lease_s")

    @property
    def resolved_worker_id(self) -> str:
        return self.worker_id or f"{self.ROLE}-{self.advertise_host}-{self.port}"
