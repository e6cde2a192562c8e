"""gateway settings."""

from __future__ import annotations

import dataclasses
from typing import ClassVar
import os
from pathlib import Path

from distserve.bearer_key import ApiKeyConfig
from distserve.config import ConfigError, require, setting
from distserve.engine.default_model import MODEL_HELP
from distserve.grpc_server import TlsConfig
from services.router.gateway import reasoning, tool_parsers

_TEMPLATE_CHARS = "{}\n"  # every Jinja template that prints or loops has one; a path has none


@dataclasses.dataclass(frozen=True)
class GatewayConfig(TlsConfig, ApiKeyConfig):
    """gateway: OpenAI-compatible HTTP API (SSE streaming) in front of the router. With an API key it
    requires `Authorization: Bearer <key>` on /v1/* and /metrics, and presents the key to the router."""

    ROLE: ClassVar[str] = "gateway"  # its certificate in tls_dir

    host: str = setting("127.0.0.1", "interface to bind the HTTP server to")
    port: int = setting(8000, "HTTP port")
    router_address: str = setting("127.0.0.1:50051", "router gRPC address, or several joined by commas: requests "
                                                     "go round them, and a stream whose router fails resumes on "
                                                     "the next", env="DISTSERVE_ROUTER_ADDRESS")
    model: str = setting("default", MODEL_HELP + "; the gateway reads its tokenizer and chat template",
                         env="DISTSERVE_MODEL")
    redis_url: str = setting("redis://127.0.0.1:6379/0", "registry Redis, read by /health",
                             env="DISTSERVE_REDIS_URL")
    served_model_name: str = setting("", "model name clients send and /v1/models lists "
                                         "(default: the model folder's name)")
    request_timeout_s: float = setting(600.0, "deadline for one request's router call")
    health_timeout_s: float = setting(1.0, "deadline for each check behind GET /health")
    router_retry_wait_s: float = setting(10.0, "before resuming a stream on the next router (or the same one, "
                                               "restarted), wait at most this long for it to connect")
    router_mux: bool = setting(True, "send every request to a router through one multiplexed stream (distserve.mux: "
                                     "fewer gRPC messages per token); false: one call per request")
    retry_after_s: int = setting(1, "Retry-After seconds sent with 429 (router out of KV capacity)")
    max_body_mb: float = setting(8.0, "largest accepted request body, in MiB")
    shutdown_grace_s: float = setting(10.0, "on SIGTERM, how long in-flight requests may still run")
    rate_limit_rps: float = setting(0.0, "requests per second each client may make to the generation endpoints "
                                         "(a client: its API key, else its address); past it, 429 with "
                                         "Retry-After (0: no limit)")
    rate_limit_burst: int = setting(0, "requests a client may make at once before rate_limit_rps applies "
                                       "(0: twice rate_limit_rps, at least 1)")
    max_connections: int = setting(4096, "open HTTP connections at most; one more is closed at once")
    header_timeout_s: float = setting(10.0, "a new connection that has not sent a whole request's headers "
                                            "within this is closed")
    body_timeout_s: float = setting(30.0, "a request whose body has not arrived within this gets 408")
    keepalive_timeout_s: float = setting(75.0, "an idle keep-alive connection is closed after this")
    chat_template: str = setting("", "Jinja chat template for chat requests, or a file holding one; overrides "
                                     "the tokenizer's (needed for a model without one)")
    tool_call_parser: str = setting("", "format tool_choice \"auto\" reads calls in: hermes, llama3_json or "
                                        "mistral (default: the one the chat template shows, if any)")
    reasoning_parser: str = setting("", "split <think> reasoning into reasoning_content: deepseek_r1 (output "
                                        "starts thinking) or qwen3 (only after <think>); default: off")

    def __post_init__(self) -> None:
        super().__post_init__()
        require(0 <= self.port < 65536, "port", f"must be in [0, 65535], got {self.port}")
        require(all(self.router_addresses), "router_address", f"must be host:port[,host:port...], got "
                                                              f"{self.router_address!r}")
        require(self.request_timeout_s > 0, "request_timeout_s", "must be > 0")
        require(self.health_timeout_s > 0, "health_timeout_s", "must be > 0")
        require(self.router_retry_wait_s >= 0, "router_retry_wait_s", "must be >= 0")
        require(self.retry_after_s >= 0, "retry_after_s", "must be >= 0")
        require(self.max_body_mb > 0, "max_body_mb", "must be > 0")
        require(self.shutdown_grace_s >= 0, "shutdown_grace_s", "must be >= 0")
        require(self.rate_limit_rps >= 0, "rate_limit_rps", "must be >= 0 (0: no limit)")
        require(self.rate_limit_burst >= 0, "rate_limit_burst", "must be >= 0")
        require(self.max_connections > 0, "max_connections", "must be > 0")
        for name in ("header_timeout_s", "body_timeout_s", "keepalive_timeout_s"):
            require(getattr(self, name) > 0, name, "must be > 0")
        require(self.tool_call_parser in ("", *tool_parsers.PARSERS), "tool_call_parser",
                f"must be one of {', '.join(tool_parsers.PARSERS)}; got {self.tool_call_parser!r}")
        require(self.reasoning_parser in ("", *reasoning.PARSERS), "reasoning_parser",
                f"must be one of {', '.join(reasoning.PARSERS)}; got {self.reasoning_parser!r}")
        self.check_api_key_settings(self.host, has_tls=False)  # its TLS is to the router; its HTTP port has none

    @property
    def rate_limit_burst_size(self) -> int:
        return self.rate_limit_burst or max(1, round(2 * self.rate_limit_rps))

    @property
    def router_addresses(self) -> list[str]:
        return [address.strip() for address in self.router_address.split(",")]

    def load_chat_template(self) -> str | None:
        """The chat template text: chat_template read from the file it names, or taken as the template itself;
        None when unset. ConfigError naming chat_template when a file cannot be read, or when the value names
        no file and has none of a template's characters (a mistyped path is not silently a template)."""
        value = self.chat_template
        if not value:
            return None
        if os.path.isfile(value):  # not Path.is_file: a long template is a name too long, which it raises on
            try:
                text = Path(value).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise ConfigError(f"chat_template: cannot read {value}: {exc}") from exc
            require(bool(text.strip()), "chat_template", f"{value} is empty")
            return text
        require(any(c in value for c in _TEMPLATE_CHARS), "chat_template",
                f"{value!r} looks like a file path, but there is no such file")
        return value
