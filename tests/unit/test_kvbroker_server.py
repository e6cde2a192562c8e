"""kvbroker servicer: Redis being down reaches callers as UNAVAILABLE, not UNKNOWN."""

from __future__ import annotations

import grpc
import pytest
import redis

from services.kvbroker.server import redis_down_is_unavailable


class AbortingContext:
    """Records the abort as grpc.aio's context does (abort raises)."""

    def __init__(self):
        self.code = self.details = None

    async def abort(self, code, details):
        self.code, self.details = code, details
        raise RuntimeError("aborted")


class Servicer:
    @redis_down_is_unavailable
    async def Method(self, request, context):
        if request == "down":
            raise redis.ConnectionError("Error 111 connecting to 127.0.0.1:6390. Connection refused.")
        return "ok"


async def test_a_redis_connection_error_aborts_unavailable_naming_redis():
    context = AbortingContext()
    with pytest.raises(RuntimeError, match="aborted"):
        await Servicer().Method("down", context)
    assert context.code == grpc.StatusCode.UNAVAILABLE
    assert "Redis is unavailable" in context.details and "Connection refused" in context.details


async def test_answers_pass_through_untouched():
    context = AbortingContext()
    assert await Servicer().Method("up", context) == "ok"
    assert context.code is None
