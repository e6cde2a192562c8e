"""router settings."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from distserve.bearer_key import ApiKeyConfig
from distserve.config import require, setting
from distserve.grpc_server import GrpcServerConfig
from distserve.spill_policy import SpillPolicy


@dataclasses.dataclass(frozen=True)
class RouterConfig(GrpcServerConfig, ApiKeyConfig):
    """router: public streaming Generate API in front of prefill and decode workers. With an API key
    (the gateway's: DISTSERVE_API_KEY) every call but health checks must present it."""

    ROLE: ClassVar[str] = "router"  # its certificate in tls_dir

    host: str = setting("127.0.0.1", "interface to bind the gRPC server to")
    metrics_port: int = setting(9100, "port of the Prometheus /metrics endpoint (0: off)")
    port: int = setting(50051, "gRPC port")
    model: str = setting("default", "HF model folder (tokenizer and limits)", env="DISTSERVE_MODEL")
    redis_url: str = setting("redis://127.0.0.1:6379/0", "registry Redis", env="DISTSERVE_REDIS_URL")
    prefix_seed: str = setting("", "seed of the prefix-cache keys, as the workers' (to read their cache events)",
                               env="DISTSERVE_PREFIX_SEED", flag=False)
    prefix_events: bool = setting(True, "follow the workers' published prefix-cache stores and evictions (the "
                                        "cluster-wide prefix index); false: estimate from this router's own routing "
                                        "only")
    broker_address: str = setting("127.0.0.1:50060", "kvbroker gRPC address; replicas comma-separated",
                                  env="DISTSERVE_BROKER_ADDRESS")
    request_timeout_s: float = setting(600.0, "deadline for one request's worker calls")
    connect_timeout_s: float = setting(2.0, "how long to wait for a worker's connection (e.g. one just restarted) "
                                            "before taking it as down")
    prefill_timeout_s: float = setting(120.0, "deadline for one Prefill call (queue and forward)")
    decode_idle_timeout_s: float = setting(60.0, "a decode worker silent this long (no token, covering block wait "
                                                 "and KV transfer before the first) is treated as stalled and the "
                                                 "request moves to another")
    registry_refresh_s: float = setting(0.5, "how often to re-read the worker registry")
    suspect_s: float = setting(5.0, "skip a worker this long after a call to it failed to connect")
    rpc_timeout_s: float = setting(5.0, "deadline for calls to the kvbroker")
    decode_mux: bool = setting(True, "carry all decode and colocated streams to a worker in one multiplexed stream "
                                     "(each engine step's tokens in one message; distserve.mux); false: one stream "
                                     "per request")
    max_request_mb: float = setting(4.0, "largest Generate request accepted, in MiB (a longer one fails with "
                                         "RESOURCE_EXHAUSTED before it is read)")
    grammar_compile_timeout_s: float = setting(2.0, "a structured-output spec (regex, JSON schema, grammar, choice) "
                                                    "that does not compile within this is refused "
                                                    "(INVALID_ARGUMENT); compiles run in a child process that is "
                                                    "killed at the deadline")
    grammar_compile_cpu_share: float = setting(0.1, "of one core, what structured-output spec compiles may "
                                                    "use over time, bursts of up to grammar_compile_timeout_s "
                                                    "of CPU aside (a flood of slow specs then waits, and "
                                                    "serving keeps the CPU)")
    max_retries: int = setting(2, "times one request may be re-prefilled and moved to other workers after "
                                  "a worker or its KV is lost (request migration)")
    spill_prefill_tokens: int = setting(SpillPolicy.prefill_tokens, "spill-only colocated workers (prefill/decode workers started with "
                                              "also_colocated) take requests once the least-loaded prefill worker "
                                              "has this many prompt tokens outstanding (0: never on that count)")
    spill_decode_running: int = setting(SpillPolicy.decode_running, "spill-only colocated workers also take requests "
                                        "once the least-loaded decode worker runs this many sequences (0: never on "
                                        "that count)")
    spill_burst_tokens: int = setting(SpillPolicy.burst_tokens, "past the prompt mark, a decode worker's spill-only "
                                      "half queues one spilled prompt at a time, and any number once the "
                                      "least-loaded prefill worker has this many prompt tokens outstanding, a "
                                      "long burst (0: never)")

    def __post_init__(self) -> None:
        super().__post_init__()
        require(0 <= self.port < 65536, "port", f"must be in [0, 65535], got {self.port}")
        require(self.request_timeout_s > 0, "request_timeout_s", "must be > 0")
        require(self.connect_timeout_s > 0, "connect_timeout_s", "must be > 0")
        require(self.prefill_timeout_s > 0, "prefill_timeout_s", "must be > 0")
        require(self.decode_idle_timeout_s > 0, "decode_idle_timeout_s", "must be > 0")
        require(self.max_retries >= 0, "max_retries", "must be >= 0")
        require(self.registry_refresh_s > 0, "registry_refresh_s", "must be > 0")
        require(self.max_request_mb > 0, "max_request_mb", "must be > 0")
        require(self.grammar_compile_timeout_s > 0, "grammar_compile_timeout_s", "must be > 0")
        require(0 < self.grammar_compile_cpu_share <= 1, "grammar_compile_cpu_share", "must be in (0, 1]")
        require(self.spill_prefill_tokens >= 0, "spill_prefill_tokens", "must be >= 0 (0: never on that count)")
        require(self.spill_decode_running >= 0, "spill_decode_running", "must be >= 0 (0: never on that count)")
        require(self.spill_burst_tokens >= 0, "spill_burst_tokens", "must be >= 0 (0: never)")
        self.check_api_key_settings(self.host, self.is_tls)
