"""kvbroker settings."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from distserve.config import require, setting
from distserve.grpc_server import GrpcServerConfig


@dataclasses.dataclass(frozen=True)
class KvBrokerConfig(GrpcServerConfig):
    """kvbroker: keeps KV handle metadata (owner, layout, state, lease) in Redis."""

    ROLE: ClassVar[str] = "kvbroker"  # its certificate in tls_dir

    host: str = setting("127.0.0.1", "interface to bind the gRPC server to")
    metrics_port: int = setting(9101, "port of the Prometheus /metrics endpoint (0: off)")
    port: int = setting(50060, "gRPC port")
    redis_url: str = setting("redis://127.0.0.1:6379/0", "Redis holding handles", env="DISTSERVE_REDIS_URL")
    default_lease_s: float = setting(30.0, "handle lease when the owner gives none")
    claim_lease_s: float = setting(30.0, "lease extension once a decode worker claims a handle")

    def __post_init__(self) -> None:
        super().__post_init__()
        require(0 <= self.port < 65536, "port", f"must be in [0, 65535], got {self.port}")
        require(self.default_lease_s > 0, "default_lease_s", "must be > 0")
        require(self.claim_lease_s > 0, "claim_lease_s", "must be > 0")
