"""prefill worker settings."""

from __future__ import annotations

import dataclasses
import os

from distserve.config import require, setting
from distserve.grpc_server import TlsConfig
from distserve.cpus import parse_cpu_list
from distserve.engine.dtype import DTYPE_CHOICES
from distserve.prefix_config import PrefixCacheConfig


@dataclasses.dataclass(frozen=True)
class PrefillConfig(PrefixCacheConfig, TlsConfig):
    """prefill worker: runs prompts and serves their KV caches over UCX."""

    host: str = setting("127.0.0.1", "interface to bind the gRPC server to")
    metrics_port: int = setting(9102, "port of the Prometheus /metrics endpoint (0: off)")
    port: int = setting(50070, "gRPC port")
    advertise_host: str = setting("127.0.0.1", "host other services use to reach this worker")
    ucx_port: int = setting(0, "UCX listener port (0: any free port)")
    worker_id: str = setting("", "unique worker id (default: prefill-<host>-<port>)")
    model: str = setting("default", "HF model folder, or default[:small|tiny]", env="DISTSERVE_MODEL")
    dtype: str = setting("auto", "model dtype; auto: bfloat16 on CUDA or on CPUs with bf16 instructions, "
                         "else float32", env="DISTSERVE_DTYPE")
    device: str = setting("cpu", "torch device", env="DISTSERVE_DEVICE")
    cpus: str = setting("", "cores to pin this worker to, e.g. 0 or 2-3 (empty: all cores the process may use)")
    serving_cpus: str = setting("", "cores for the serving threads (event loop, gRPC, KV transfers), e.g. 0-1; "
                                    "forwards stay on cpus (empty: the same cores as cpus)")
    core_turns: str = setting("", "directory of the compute turns of the workers sharing these cores: each forward "
                                  "waits for its turn, turns alternate (empty: no turns, the cores are its own)")
    redis_url: str = setting("redis://127.0.0.1:6379/0", "registry Redis", env="DISTSERVE_REDIS_URL")
    broker_address: str = setting("127.0.0.1:50060", "kvbroker gRPC address", env="DISTSERVE_BROKER_ADDRESS")
    max_batch_tokens: int = setting(0, "saturation length: prompt tokens per packed forward; longer prompts "
                                       "are chunked (0: auto, the engine's measured default for the device)")
    max_queued_tokens: int = setting(0, "most prompt tokens queued or running at once; a Prefill beyond it fails "
                                        "RESOURCE_EXHAUSTED at once (0: 256 forwards' worth, 256 x max_batch_tokens: "
                                        "bursts queue, a flood is refused)")
    queue_timeout_s: float = setting(60.0, "a prompt no forward has started on within this fails DEADLINE_EXCEEDED")
    kv_lease_s: float = setting(30.0, "free a held KV this long after registering if no one claims it")
    max_held_kv_bytes: int = setting(0, "most KV bytes held for decode workers at once; a Prefill that would "
                                        "exceed it fails RESOURCE_EXHAUSTED (0: a quarter of physical memory)")
    also_colocated: bool = setting(False, "also serve whole requests (ColocatedService), prefilled and decoded here; "
                                          "the router sends them only while the prefill/decode pairs are saturated")
    colocated_kv_cache_mb: int = setting(1024, "with also_colocated: paged KV cache for the requests decoded here, MiB")
    heartbeat_s: float = setting(1.0, "registry heartbeat interval")
    lease_s: float = setting(3.0, "registry lease: the worker vanishes this long after its last heartbeat")
    rpc_timeout_s: float = setting(5.0, "deadline for calls to the kvbroker")
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
        require(self.max_queued_tokens >= 0, "max_queued_tokens", "must be >= 0 (0: auto)")
        require(self.queue_timeout_s > 0, "queue_timeout_s", "must be > 0")
        require(self.kv_lease_s > 0, "kv_lease_s", "must be > 0")
        require(self.max_held_kv_bytes >= 0, "max_held_kv_bytes", "must be >= 0 (0: a quarter of physical memory)")
        require(0 < self.heartbeat_s < self.lease_s, "heartbeat_s", "must be > 0 and below lease_s")
        require(self.colocated_kv_cache_mb > 0, "colocated_kv_cache_mb", "must be > 0")
        require(not (self.also_colocated and self.core_turns), "also_colocated",
                "cannot be combined with core_turns (the colocated loop does not take turns)")

    @property
    def resolved_worker_id(self) -> str:
        return self.worker_id or f"prefill-{self.advertise_host}-{self.port}"

    @property
    def resolved_max_held_kv_bytes(self) -> int:
        return self.max_held_kv_bytes or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
