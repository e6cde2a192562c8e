"""The live worker registry in Redis: workers publish themselves under a lease.

Each worker writes `distserve:worker:<role>:<worker_id>` (JSON) with a TTL of
`lease_s` and refreshes it every heartbeat; a worker that stops (or dies)
disappears when the key expires or on graceful deregistration. A sorted set
per role (`distserve:workers:<role>`, worker id scored by lease expiry) indexes
the keys, so listing never scans the keyspace.

Every timestamp here is Redis's clock (the TIME command), never the caller's:
workers and router may run on machines whose clocks disagree, and a worker
whose clock runs behind would otherwise look expired to a router whose clock
runs ahead (or never expire, the other way round).

With a registry key configured (distserve.record_signing), a record carries a `mac` field over the rest
of it and its Redis key; a reader drops one whose MAC is missing or wrong, so a worker forged or
rewritten in Redis by someone without the key is never listed (never routed to, never dialled).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import uuid
from typing import Callable

import redis
import redis.asyncio as aioredis

from distserve.record_signing import WORKER, RecordSigner, process_signer
from distserve.redis_client import raise_if_cancelled

log = logging.getLogger(__name__)

KEY_PREFIX = "distserve:worker:"
# A worker whose lease lapsed (no heartbeat: hung, paused or dead; a graceful exit deregisters instead)
# stays in its role's index this long after, so that every router's next refresh sees it lapse.
LAPSED_KEPT_S = 60.0
# A random id the first router to read it writes: a different one means Redis lost its data (restarted
# without persistence, or flushed), not that every worker left (WorkerRegistry.data_epoch).
EPOCH_KEY = "distserve:registry:epoch"
SPILLING_KEY = "distserve:spilling"  # set (with a short expiry) by a router while it spills requests
MAC_FIELD = "mac"  # the record's signature, in its JSON (absent when unsigned)


@dataclasses.dataclass
class WorkerRecord:
    """What a worker tells the router about itself."""

    worker_id: str
    role: str  # "prefill" | "decode"
    address: str  # host:port of its gRPC server
    ucx_address: str = ""  # host:port of its UCX listener (prefill)
    load: dict[str, float] = dataclasses.field(default_factory=dict)
    kv_format: str = ""  # KV layout and dtype; a prefill worker's KV only fits a decode worker's of the same
    updated_at: float = 0.0


def worker_key(role: str, worker_id: str) -> str:
    return f"{KEY_PREFIX}{role}:{worker_id}"


def index_key(role: str) -> str:
    return f"distserve:workers:{role}"


async def server_time(redis: aioredis.Redis) -> float:
    """Seconds since the epoch by the Redis server's clock."""
    seconds, microseconds = await redis.time()
    return seconds + microseconds / 1e6


class WorkerRegistry:
    def __init__(self, redis: aioredis.Redis, lease_s: float, signer: RecordSigner | None = None):
        """signer: signs the records published and checks those listed (default: this process's, from
        its environment: record_signing.process_signer)."""
        self._redis = redis
        self.lease_s = lease_s
        self._signer = signer or process_signer()

    async def publish(self, record: WorkerRecord) -> None:
        """Writes the record under a lease of lease_s; sets record.updated_at to Redis's time."""
        record.updated_at = await server_time(self._redis)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.set(worker_key(record.role, record.worker_id), encode_record(record, self._signer),
                     px=int(self.lease_s * 1000))
            pipe.zadd(index_key(record.role), {record.worker_id: record.updated_at + self.lease_s})
            await pipe.execute()

    async def remove(self, role: str, worker_id: str) -> None:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(worker_key(role, worker_id))
            pipe.zrem(index_key(role), worker_id)
            await pipe.execute()

    async def mark_spilling(self, hold_s: float) -> None:
        """Records that this router is spilling requests (sent to spill-only colocated workers) now; the
        mark lapses hold_s later unless renewed. Read by lists_now (the launcher's control placement)."""
        await self._redis.set(SPILLING_KEY, 1, px=int(hold_s * 1000))

    async def data_epoch(self) -> str:
        """An id of Redis's data: it changes when Redis loses its keys (restart without persistence,
        flush), as the first reader after that writes a fresh one. Needs SET and GET on EPOCH_KEY."""
        return (await self.snapshot(())).epoch

    async def list(self, role: str) -> list[WorkerRecord]:
        """Live workers of a role; records that fail to parse are skipped (and logged)."""
        return (await self._read((role,), with_epoch=False)).workers[role]

    async def list_and_lapsed(self, role: str) -> tuple[list[WorkerRecord], set[str]]:
        """Live workers of a role, and the ids of those whose lease lapsed within LAPSED_KEPT_S."""
        found = await self._read((role,), with_epoch=False)
        return found.workers[role], found.lapsed

    async def snapshot(self, roles: tuple[str, ...]) -> RegistrySnapshot:
        """The data epoch, and every role's live and lapsed workers (index entries lapsed longer than
        LAPSED_KEPT_S are pruned), in three round trips whatever the number of roles (a router refreshes
        twice a second). Needs the router's grants (SET and GET on EPOCH_KEY)."""
        return await self._read(roles, with_epoch=True)

    async def _read(self, roles: tuple[str, ...], with_epoch: bool) -> RegistrySnapshot:
        now = await server_time(self._redis) if roles else 0.0
        async with self._redis.pipeline(transaction=False) as pipe:
            if with_epoch:
                pipe.set(EPOCH_KEY, uuid.uuid4().hex, nx=True)
                pipe.get(EPOCH_KEY)
            for role in roles:
                pipe.zremrangebyscore(index_key(role), "-inf", now - LAPSED_KEPT_S)
                pipe.zrange(index_key(role), 0, -1, withscores=True)
            replies = await pipe.execute()
        epoch = replies[1].decode() if with_epoch else ""
        found = RegistrySnapshot(epoch, {role: [] for role in roles}, set())
        entries = replies[2 if with_epoch else 0:][1::2]
        live = {}
        for role, listed in zip(roles, entries):
            live[role] = [i.decode() for i, expires_at in listed if expires_at > now]
            found.lapsed |= {i.decode() for i, expires_at in listed if expires_at <= now}
        if not any(live.values()):
            return found
        async with self._redis.pipeline(transaction=False) as pipe:
            for role in roles:
                if live[role]:
                    pipe.mget([worker_key(role, i) for i in live[role]])
            values = iter(await pipe.execute())
        for role in roles:
            if live[role]:
                found.workers[role] = _parse_records(role, live[role], next(values), self._signer)
        return found


@dataclasses.dataclass
class RegistrySnapshot:
    """One read of the registry (WorkerRegistry.snapshot)."""

    epoch: str  # WorkerRegistry.data_epoch ("" where not read)
    workers: dict[str, list[WorkerRecord]]  # role -> live workers
    lapsed: set[str]  # ids of workers whose lease lapsed within LAPSED_KEPT_S: hung, paused or dead


def lists_now(client: redis.Redis, roles: tuple[str, ...],
              signer: RecordSigner | None = None) -> tuple[bool, dict[str, list[WorkerRecord]]]:
    """Whether some router marked itself spilling within its hold time (WorkerRegistry.mark_spilling), and
    the live workers of every role in `roles` (WorkerRegistry.list, read only: expired index entries are
    left for the workers' registries to prune), with a synchronous client, for threads outside an event
    loop (the launcher's control placement, ten times a second on cores the workers use): three
    pipelined round trips to Redis. signer: as WorkerRegistry's."""
    with client.pipeline(transaction=False) as pipe:
        pipe.exists(SPILLING_KEY)
        pipe.time()
        spilling, (seconds, microseconds) = pipe.execute()
    with client.pipeline(transaction=False) as pipe:
        for role in roles:
            pipe.zrangebyscore(index_key(role), seconds + microseconds / 1e6, "+inf")
        ids = {role: [i.decode() for i in found] for role, found in zip(roles, pipe.execute())}
    with client.pipeline(transaction=False) as pipe:
        for role in roles:
            if ids[role]:
                pipe.mget([worker_key(role, i) for i in ids[role]])
        values = iter(pipe.execute())
    signer = signer or process_signer()
    return bool(spilling), {role: _parse_records(role, ids[role], next(values), signer) if ids[role] else []
                            for role in roles}


def encode_record(record: WorkerRecord, signer: RecordSigner) -> str:
    """The record's JSON as stored, with its MAC when the signer has a key."""
    fields = dataclasses.asdict(record)
    mac = signer.mac(WORKER, worker_key(record.role, record.worker_id), _canonical(fields))
    return json.dumps({**fields, MAC_FIELD: mac} if mac else fields)


def _canonical(fields: dict) -> bytes:
    """The bytes a record's MAC covers: its fields but the MAC, in one spelling whoever encodes them (JSON
    round-trips every value a record holds: strings, ints, floats, bools)."""
    return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()


def _parse_records(role: str, ids: list[str], values: list[bytes | None], signer: RecordSigner) -> list[WorkerRecord]:
    """The records stored for `ids`; expired keys (None), malformed records (logged) and, with a key,
    records whose MAC is missing or wrong (signer.accepts) are skipped."""
    records = []
    for worker_id, value in zip(ids, values):
        if value is None:  # expired, its index entry not yet pruned
            continue
        try:
            fields = json.loads(value)
            mac = fields.pop(MAC_FIELD, None)
            if signer.accepts(WORKER, worker_key(role, worker_id), _canonical(fields), mac):
                records.append(WorkerRecord(**fields))
        except (ValueError, TypeError, AttributeError) as exc:  # AttributeError: JSON that is not an object
            log.warning("ignoring malformed %s registry record: %s", role, exc)
    return records


async def heartbeat(registry: WorkerRegistry, make_record: Callable[[], WorkerRecord], interval_s: float,
                    stop: asyncio.Event | None = None) -> None:
    """Publishes make_record() every interval_s until `stop` is set (or cancelled); survives Redis blips.

    Stopping via `stop` never interrupts a publish, so once this returns no heartbeat is in flight
    and a deregistration that follows cannot be undone by a late one.
    """
    stop = stop or asyncio.Event()
    while not stop.is_set():
        try:
            await registry.publish(make_record())
        except (aioredis.RedisError, OSError) as exc:
            log.warning("heartbeat failed: %s", exc)
        raise_if_cancelled()
        try:
            await asyncio.wait_for(stop.wait(), interval_s)
        except asyncio.TimeoutError:
            pass
