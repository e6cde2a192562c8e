"""WorkerRegistry against a real redis-server: publish, list, remove, lease expiry, heartbeat."""

from __future__ import annotations

import asyncio
import time

import redis.asyncio as aioredis
import torch

from distserve.engine.compute_thread import ComputeThread
from distserve.record_signing import RecordSigner
from distserve.registry import MAC_FIELD, WorkerRecord, WorkerRegistry, heartbeat, index_key, worker_key

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


class SkewedClock:
    """A redis client whose TIME answers `skew_s` off the real server's: another machine's view of time."""

    def __init__(self, client: aioredis.Redis, skew_s: float):
        self._client = client
        self.skew_s = skew_s
        self.num_time_calls = 0

    async def time(self):
        self.num_time_calls += 1
        seconds, microseconds = await self._client.time()
        return int(seconds + self.skew_s), microseconds

    def __getattr__(self, name):
        return getattr(self._client, name)


async def test_liveness_follows_the_redis_clock_not_the_local_one(redis_client, monkeypatch):
    # A worker whose clock is an hour behind publishes; a router with a right clock lists (and the reverse).
    registry = WorkerRegistry(redis_client, lease_s=30)
    real_time = time.time
    for worker_skew_s in (-3600.0, 3600.0):
        monkeypatch.setattr(time, "time", lambda skew=worker_skew_s: real_time() + skew)
        await registry.publish(record("p0"))
        monkeypatch.undo()
        assert [r.worker_id for r in await registry.list("prefill")] == ["p0"]
        await registry.remove("prefill", "p0")


async def test_publish_stamps_and_list_prunes_by_server_time(redis_client):
    # Publishing while Redis's clock reads an hour ago gives an index entry that is stale by the real clock.
    skewed = SkewedClock(redis_client, skew_s=-3600)
    await WorkerRegistry(skewed, lease_s=30).publish(record("p0"))
    (server_seconds, _) = await redis_client.time()
    assert abs(float(await redis_client.zscore(index_key("prefill"), "p0")) - (server_seconds - 3600 + 30)) < 2
    assert skewed.num_time_calls == 1
    listed = await WorkerRegistry(skewed, lease_s=30).list("prefill")  # by the clock it was stamped with: live
    assert [r.worker_id for r in listed] == ["p0"] and skewed.num_time_calls == 2
    assert await WorkerRegistry(redis_client, lease_s=30).list("prefill") == []  # by the real one: expired


class CancellationSwallowingRegistry:
    """Catches a cancellation inside publish and returns normally, as redis-py 8.1 sometimes does when
    one lands mid-command (about 1 in 10 heartbeats cancelled within 20 ms of starting, real Redis)."""

    def __init__(self):
        self.publishes = 0
        self.publishing = asyncio.Event()

    async def publish(self, record) -> None:
        self.publishes += 1
        self.publishing.set()
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            pass


async def test_a_heartbeat_cancelled_inside_a_publish_that_swallows_it_still_ends():
    registry = CancellationSwallowingRegistry()
    task = asyncio.create_task(heartbeat(registry, lambda: record("p0"), interval_s=0.01))
    await registry.publishing.wait()
    task.cancel()
    done, _ = await asyncio.wait([task], timeout=5)
    assert task in done and task.cancelled()
    assert registry.publishes == 1


KEY = b"registry-test-key-" + b"0" * 32


async def test_a_signed_registry_lists_its_own_records_and_the_mac_travels_in_the_json(redis_client):
    import json

    registry = WorkerRegistry(redis_client, lease_s=30, signer=RecordSigner(KEY))
    published = record("p0", ucx_address="127.0.0.1:7000", load={"num_waiting": 3, "free": 0.25, "spill_only": True})
    await registry.publish(published)
    assert await registry.list("prefill") == [published]
    assert len(json.loads(await redis_client.get(worker_key("prefill", "p0")))[MAC_FIELD]) == 64


async def test_records_forged_rewritten_or_moved_in_redis_are_not_listed_by_a_signed_reader(redis_client):
    import json

    rejected = []
    registry = WorkerRegistry(redis_client, lease_s=30, signer=RecordSigner(KEY, rejected.append))
    await registry.publish(record("p0"))
    stored = json.loads(await redis_client.get(worker_key("prefill", "p0")))
    expires_at = (await redis_client.zscore(index_key("prefill"), "p0"))

    async def plant(worker_id: str, fields: dict) -> None:
        await redis_client.set(worker_key("prefill", worker_id), json.dumps(fields))
        await redis_client.zadd(index_key("prefill"), {worker_id: expires_at})

    await plant("forged", {**stored, "worker_id": "forged", "address": "10.6.6.6:1"})  # its MAC is p0's
    await plant("unsigned", {k: v for k, v in stored.items() if k != MAC_FIELD} | {"worker_id": "unsigned"})
    await plant("p1", stored)  # p0's record, signature and all, copied under another id
    assert [w.worker_id for w in await registry.list("prefill")] == ["p0"]
    await plant("p0", {**stored, "address": "10.6.6.6:50070"})  # rewritten in place, its MAC kept
    assert await registry.list("prefill") == []
    assert rejected == ["worker"] * 7, "each read of a bad record counts (3 the first time, 4 the second)"


async def test_a_reader_without_a_key_lists_signed_and_unsigned_records_as_before(redis_client):
    await WorkerRegistry(redis_client, lease_s=30, signer=RecordSigner(KEY)).publish(record("p0"))
    await WorkerRegistry(redis_client, lease_s=30, signer=RecordSigner(None)).publish(record("p1"))
    unsigned_reader = WorkerRegistry(redis_client, lease_s=30, signer=RecordSigner(None))
    assert sorted(w.worker_id for w in await unsigned_reader.list("prefill")) == ["p0", "p1"]
    signed_reader = WorkerRegistry(redis_client, lease_s=30, signer=RecordSigner(KEY))
    assert [w.worker_id for w in await signed_reader.list("prefill")] == ["p0"]


async def test_a_long_forward_on_the_compute_thread_does_not_stop_the_heartbeat(redis_client):
    """A legitimately long forward (4 s here: torch matmuls on the engine's one compute thread) is not a stall:
    heartbeats come from the event loop, which the forward leaves free, so the 1 s lease never lapses."""
    lease_s = 1.0
    registry = WorkerRegistry(redis_client, lease_s=lease_s)
    compute = ComputeThread("test-forward")

    def long_forward() -> float:
        a = torch.randn(384, 384)
        started = time.monotonic()
        while time.monotonic() - started < 4.0:
            a = torch.tanh(a @ a)
        return time.monotonic() - started

    beat = asyncio.create_task(heartbeat(registry, lambda: record("p0"), interval_s=0.25))
    forward = asyncio.ensure_future(compute.run(long_forward))
    listed_throughout = []
    try:
        while not forward.done():
            await asyncio.sleep(0.2)
            listed_throughout.append(len(await registry.list("prefill")) == 1)
        assert await forward >= 4.0
        assert len(listed_throughout) >= 10 and all(listed_throughout)
    finally:
        beat.cancel()
        await asyncio.gather(beat, return_exceptions=True)


async def test_the_data_epoch_stays_until_redis_loses_its_keys(redis_client):
    registry = WorkerRegistry(redis_client, lease_s=5)
    first = await registry.data_epoch()
    assert await registry.data_epoch() == first
    await redis_client.flushdb()  # what a restart without persistence leaves
    assert await registry.data_epoch() != first


async def test_a_snapshot_reads_every_role_and_the_epoch_at_once(redis_client):
    registry = WorkerRegistry(redis_client, lease_s=30)
    for r in [record("p0"), record("d0", role="decode"), record("d1", role="decode")]:
        await registry.publish(r)
    await redis_client.zadd(index_key("decode"), {"d1": 0})  # d1's lease long gone: pruned, not lapsed
    await redis_client.zadd(index_key("prefill"), {"p1": (await redis_client.time())[0] - 1})  # lapsed just now
    found = await registry.snapshot(("prefill", "decode", "colocated"))
    assert found.epoch == await registry.data_epoch()
    assert {role: [w.worker_id for w in workers] for role, workers in found.workers.items()} == {
        "prefill": ["p0"], "decode": ["d0"], "colocated": []}
    assert found.lapsed == {"p1"}
    assert await redis_client.zscore(index_key("decode"), "d1") is None
