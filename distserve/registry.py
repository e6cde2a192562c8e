"""The live worker registry in Redis: workers publish themselves under a lease.

Each worker writes `distserve:worker:<role>:<worker_id>` (JSON) with a TTL of
`lease_s` and refreshes it every heartbeat; a worker that stops (or dies)
disappears when the key expires or on graceful deregistration. The router
lists a role's keys to choose workers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from typing import Callable

import redis.asyncio as aioredis

log = logging.getLogger(__name__)

KEY_PREFIX = "distserve:worker:"


@dataclasses.dataclass
class WorkerRecord:
    """What a worker tells the router about itself."""

    worker_id: str
    role: str  # "prefill" | "decode"
    address: str  # host:port of its gRPC server
    ucx_address: str = ""  # host:port of its UCX listener (prefill)
    load: dict[str, float] = dataclasses.field(default_factory=dict)
    updated_at: float = 0.0


def worker_key(role: str, worker_id: str) -> str:
    return f"{KEY_PREFIX}{role}:{worker_id}"


class WorkerRegistry:
    def __init__(self, redis: aioredis.Redis, lease_s: float):
        self._redis = redis
        self.lease_s = lease_s

    async def publish(self, record: WorkerRecord) -> None:
        record.updated_at = time.time()
        await self._redis.set(
            worker_key(record.role, record.worker_id),
            json.dumps(dataclasses.asdict(record)),
            px=int(self.lease_s * 1000),
        )

    async def remove(self, role: str, worker_id: str) -> None:
        await self._redis.delete(worker_key(role, worker_id))

    async def list(self, role: str) -> list[WorkerRecord]:
        keys = [k async for k in self._redis.scan_iter(match=f"{KEY_PREFIX}{role}:*", count=500)]
        if not keys:
            return []
        values = await self._redis.mget(keys)
        return [WorkerRecord(**json.loads(v)) for v in values if v is not None]


async def heartbeat(registry: WorkerRegistry, make_record: Callable[[], WorkerRecord], interval_s: float) -> None:
    """Publishes make_record() every interval_s until cancelled; survives Redis blips."""
    while True:
        try:
            await registry.publish(make_record())
        except (aioredis.RedisError, OSError) as exc:
            log.warning("heartbeat failed: %s", exc)
        await asyncio.sleep(interval_s)
