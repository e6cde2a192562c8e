"""prefill worker settings."""

from __future__ import annotations

import dataclasses
import os
from typing import ClassVar

from distserve.config import require, setting
from distserve.worker_config import WorkerConfig

KV_PEERS = ("registry", "any")


@dataclasses.dataclass(frozen=True)
class PrefillConfig(WorkerConfig):
    """prefill worker: runs prompts and serves their KV caches over UCX."""

    ROLE: ClassVar[str] = "prefill"

    metrics_port: int = setting(9102, "port of the Prometheus /metrics endpoint (0: off)")
    port: int = setting(50070, "gRPC port")
    ucx_port: int = setting(0, "UCX listener port (0: any free port)")
    core_turns: str = setting("", "directory of the compute turns of the workers sharing these cores: each forward "
                                  "waits for its turn, turns alternate (empty: no turns, the cores are its own)")
    broker_address: str = setting("127.0.0.1:50060", "kvbroker gRPC address; replicas comma-separated",
                                  env="DISTSERVE_BROKER_ADDRESS")
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
    rpc_timeout_s: float = setting(5.0, "deadline for calls to the kvbroker")
    kv_peers: str = setting("registry", "who may connect to the UCX listener to pull KV: registry (connections "
                                        "arriving on advertise_host from hosts of registered decode or colocated "
                                        "workers) or any (anyone; each pull still needs its kv_secret)")

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.max_queued_tokens >= 0, "max_queued_tokens", "must be >= 0 (0: auto)")
        require(self.queue_timeout_s > 0, "queue_timeout_s", "must be > 0")
        require(self.kv_lease_s > 0, "kv_lease_s", "must be > 0")
        require(self.max_held_kv_bytes >= 0, "max_held_kv_bytes", "must be >= 0 (0: a quarter of physical memory)")
        require(self.colocated_kv_cache_mb > 0, "colocated_kv_cache_mb", "must be > 0")
        require(self.kv_peers in KV_PEERS, "kv_peers", f"must be one of {list(KV_PEERS)}, got {self.kv_peers!r}")
        require(not (self.also_colocated and self.core_turns), "also_colocated",
                "cannot be combined with core_turns (the colocated loop does not take turns)")

    @property
    def resolved_max_held_kv_bytes(self) -> int:
        return self.max_held_kv_bytes or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
