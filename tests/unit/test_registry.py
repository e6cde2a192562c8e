"""WorkerRegistry against a real redis-server: publish, list, remove, lease expiry, heartbeat."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from distserve.registry import WorkerRecord, WorkerRegistry, heartbeat, worker_key

LEASE_S = 0.3


def record(worker_id: str = "p0", role: str = "prefill", **kwargs) -> WorkerRecord:
    return WorkerRecord(worker_id=worker_id, role=role, address=f"{worker_id}.local:50070", **kwargs)


async def test_publish_then_list_round_trips_the_record(redis_client):
    registry = WorkerRegistry(redis_client, lease_s=30)
    published = record("p0", ucx_address="127.0.0.1:7000", load={"num_waiting": 3.0})
    await registry.publish(published)

    (listed,) = await registry.list("prefill")
    assert listed == published
    assert listed.updated_at > 0
    assert await registry.list("decode") == []


async def test_list_returns_only_the_roles_workers(redis_client):
    registry = WorkerRegistry(redis_client, lease_s=30)
    for r in [record("p0"), record("p1"), record("d0", role="decode")]:
        await registry.publish(r)
    assert sorted(r.worker_id for r in await registry.list("prefill")) == ["p0", "p1"]
    assert [r.worker_id for r in await registry.list("decode")] == ["d0"]


async def test_remove_deletes_one_worker(redis_client):
    registry = WorkerRegistry(redis_client, lease_s=30)
    await registry.publish(record("p0"))
    await registry.publish(record("p1"))
    await registry.remove("prefill", "p0")
    assert [r.worker_id for r in await registry.list("prefill")] == ["p1"]
    await registry.remove("prefill", "p0")  # removing again is harmless
    assert await redis_client.exists(worker_key("prefill", "p0")) == 0


async def test_record_expires_after_the_lease(redis_client):
    registry = WorkerRegistry(redis_client, lease_s=LEASE_S)
    await registry.publish(record("p0"))
    assert 0 < await redis_client.pttl(worker_key("prefill", "p0")) <= LEASE_S * 1000
    await asyncio.sleep(LEASE_S + 0.15)
    assert await registry.list("prefill") == []


async def test_heartbeat_keeps_the_record_alive_until_cancelled(redis_client):
    lease_s = 0.5  # room for a loaded machine to be late with a beat
    registry = WorkerRegistry(redis_client, lease_s=lease_s)
    beats = []

    def make_record():
        beats.append(1)
        return record("p0", load={"beat": float(len(beats))})

    task = asyncio.create_task(heartbeat(registry, make_record, interval_s=0.05))
    try:
        await asyncio.sleep(lease_s * 1.5)
        (listed,) = await registry.list("prefill")
        assert listed.load["beat"] >= 3
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    await asyncio.sleep(lease_s + 0.15)
    assert await registry.list("prefill") == []


class FlakyRegistry:
    """Fails the first publishes as a Redis outage would."""

    def __init__(self, failures: int):
        self.failures = failures
        self.published: list[WorkerRecord] = []

    async def publish(self, rec: WorkerRecord) -> None:
        if self.failures:
            self.failures -= 1
            raise aioredis.ConnectionError("redis down")
        self.published.append(rec)


async def test_heartbeat_survives_redis_errors():
    registry = FlakyRegistry(failures=2)
    task = asyncio.create_task(heartbeat(registry, record, interval_s=0.01))
    try:
        for _ in range(200):
            if registry.published:
                break
            await asyncio.sleep(0.01)
        assert registry.failures == 0 and registry.published
        assert not task.done()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
