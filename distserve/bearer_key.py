"""Bearer keys on gRPC: with DISTSERVE_API_KEY set, the router's API wants the gateway's key.

Clients send it as `authorization: Bearer KEY` metadata (`call_metadata`); the router's server
interceptor refuses a call without it (UNAUTHENTICATED) before any handler runs. Health checks and
reflection stay open, for probes, as the gateway's /health does.
"""

from __future__ import annotations

import dataclasses
import hmac
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

    def check_api_key_settings(self) -> None:
        require(not (self.api_key and self.api_key_file), "api_key_file",
                "set either DISTSERVE_API_KEY or api_key_file, not both")

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
