"""Bearer keys on gRPC: with DISTSERVE_API_KEY set, the router's API wants the gateway's key.

Clients send it as `authorization: Bearer KEY` metadata (`call_metadata`); the router's server
interceptor refuses a call without it (UNAUTHENTICATED) before any handler runs. Health checks and
reflection stay open, for probes, as the gateway's /health does.
"""

from __future__ import annotations

import dataclasses
import hmac
import ipaddress
import os
from pathlib import Path

import grpc

from distserve.config import ConfigError, require, setting

ENV = "DISTSERVE_API_KEY"
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


@dataclasses.dataclass(frozen=True)
class ApiKeyConfig:
    """The deployment's API key, for the services that take one (the gateway, the router): from the
    environment or a file, never a flag (a command line is visible to every user through `ps`)."""

    api_key: str = setting("", "when set, require `authorization: Bearer <key>` on every call but health "
                               "checks; environment only (a flag would show the key to `ps`)",
                           env=ENV, flag=False)
    api_key_file: str = setting("", "file holding the API key (one line); instead of DISTSERVE_API_KEY",
                                env="DISTSERVE_API_KEY_FILE")
    allow_unauthenticated: bool = setting(False, "serve on a non-loopback host without an API key or mutual "
                                                 "TLS (e.g. inside a container network that is itself closed)")

    def check_api_key_settings(self, host: str, has_tls: bool) -> None:
        """ConfigError naming the field: both a key and a key file; or a non-loopback `host` with neither a
        key nor TLS, unless allow_unauthenticated says so (anyone who reaches the port could call it)."""
        require(not (self.api_key and self.api_key_file), "api_key_file",
                "set either DISTSERVE_API_KEY or api_key_file, not both")
        require(is_loopback(host) or self.api_key or self.api_key_file or has_tls or self.allow_unauthenticated,
                "host", f"{host} is not a loopback address, and without an API key (DISTSERVE_API_KEY or "
                        "--api-key-file) or mutual TLS anyone who reaches it could call it; set one, or pass "
                        "--allow-unauthenticated where the network itself is closed")

    def with_api_key_from_file(self):
        """This config with api_key read from api_key_file (when set); ConfigError naming it if unreadable."""
        if not self.api_key_file:
            return self
        try:
            key = Path(self.api_key_file).read_text().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"api_key_file: cannot read {self.api_key_file}: {exc}") from exc
        require(bool(key), "api_key_file", f"{self.api_key_file} is empty")
        return dataclasses.replace(self, api_key=key, api_key_file="")


def is_loopback(host: str) -> bool:
    """Whether `host` (an IP address or name) binds the loopback interface only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # another name: it may resolve to anything
        return False


def key_from_env() -> str:
    """The deployment's API key from DISTSERVE_API_KEY ("" when unset)."""
    return os.environ.get(ENV, "").strip()


def call_metadata(key: str) -> tuple[tuple[str, str], ...] | None:
    """The metadata that presents `key` on a call (None without a key: gRPC's default)."""
    return (("authorization", f"Bearer {key}"),) if key else None


class BearerKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call but health and reflection that does not present `key` (constant-time compare)."""

    def __init__(self, key: str):
        if not key:
            raise ValueError("an empty key would admit every caller")
        self._expected = f"Bearer {key}".encode()

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(OPEN_METHOD_PREFIXES):
            return handler
        presented = dict(handler_call_details.invocation_metadata or ()).get("authorization", "")
        if isinstance(presented, bytes):
            presented = presented.decode(errors="replace")
        if hmac.compare_digest(presented.encode(), self._expected):
            return handler
        return _refusing(handler)


async def _refuse(request, context) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                        "authorization: this API needs `authorization: Bearer <key>` metadata with the "
                        "deployment's key (DISTSERVE_API_KEY)")


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that refuses the call."""
    serializers = dict(request_deserializer=handler.request_deserializer,
                       response_serializer=handler.response_serializer)
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(_refuse, **serializers)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(_refuse, **serializers)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(_refuse, **serializers)
    return grpc.stream_stream_rpc_method_handler(_refuse, **serializers)
