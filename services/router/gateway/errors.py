"""OpenAI error objects, and the mapping from router gRPC status codes to HTTP statuses.

Every failure a client sees is `{"error": {"message", "type", "param", "code"}}`:
400 for a bad request (param names the field as the client spelled it), 401 bad
API key, 404 unknown model or route, 429 router out of KV capacity (with
Retry-After), 503 no workers or router unreachable, 504 deadline passed, and
500 only for bugs.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

import grpc

# Router validation errors read "<field>: <message>" (services.router.validation.InvalidRequest).
_FIELD_MESSAGE = re.compile(r"^([a-z_]+): (.*)$", re.DOTALL)


@dataclasses.dataclass
class ApiError(Exception):
    """A failure to report to the client; `body()` is the OpenAI error object."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    retry_after_s: int | None = None  # 429 only

    def __str__(self) -> str:
        return f"{self.status} {self.message}"

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        return {} if self.retry_after_s is None else {"Retry-After": str(self.retry_after_s)}


def bad_request(param: str | None, message: str) -> ApiError:
    """400 for the field `param` (None: the request as a whole); the message names the field."""
    text = f"{param}: {message}" if param else message
    return ApiError(400, text, param=param, code="invalid_value" if param else "invalid_request")


def internal_error(message: str = "internal error") -> ApiError:
    return ApiError(500, message, type="server_error", code="internal_error")


def from_router_error(code: grpc.StatusCode, details: str, params: Mapping[str, str], retry_after_s: int) -> ApiError:
    """Maps a failed router call to the client's error.

    `params` renames router request fields to the client's (e.g. prompt -> messages
    for chat), so `param` is a field the client actually sent.
    """
    details = details or code.name
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        match = _FIELD_MESSAGE.match(details)
        if match is None:  # a worker's message without a field
            return bad_request(None, details)
        param = params.get(match.group(1), match.group(1))
        return bad_request(param, match.group(2))
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in details:  # the router's message cap
        return ApiError(413, f"the request is too large for the router: {details}", code="request_too_large")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return ApiError(429, f"the server is out of capacity, retry later ({details})", type="rate_limit_error",
                        code="rate_limit_exceeded", retry_after_s=retry_after_s)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
        # CANCELLED reaches here only when the router dropped the call (e.g. it is shutting down).
        return ApiError(503, f"the service is unavailable: {details}", type="server_error",
                        code="service_unavailable")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return ApiError(504, f"the request timed out: {details}", type="server_error", code="timeout")
    return internal_error(f"router error {code.name}: {details}")
