"""Handle records in Redis.

Key `distserve:kv:<handle_id>` is a hash {handle: KvHandle bytes, state, owner}
with a TTL equal to the lease. Registering refuses an id that exists and claiming
is atomic (Lua scripts each), so a record is never overwritten and exactly one
decode worker can claim a handle. Releasing deletes the key and publishes the
handle id on the owner's channel `distserve:kv-release:<owner_worker_id>`,
which tells the prefill worker to free the buffer.

Lifecycle: READY --claim--> CLAIMED --release--> (deleted)
           READY/CLAIMED --lease expires--> (deleted; the owner frees on its own timer)
"""

from __future__ import annotations

import time

import redis.asyncio as aioredis

from distserve.v1 import kvbroker_pb2

HANDLE_KEY_PREFIX = "distserve:kv:"
RELEASE_CHANNEL_PREFIX = "distserve:kv-release:"

# Creates the record unless the key exists: 1 when created, 0 when the id is taken.
_REGISTER = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], 'handle', ARGV[1], 'state', 'ready', 'owner', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
"""

# Returns the stored handle bytes on success, 0 when missing, 1 when not READY.
_CLAIM = """
local state = redis.call('HGET', KEYS[1], 'state')
if not state then return 0 end
if state ~= 'ready' then return 1 end
redis.call('HSET', KEYS[1], 'state', 'claimed')
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return redis.call('HGET', KEYS[1], 'handle')
"""


def handle_key(handle_id: str) -> str:
    return HANDLE_KEY_PREFIX + handle_id


def release_channel(owner_worker_id: str) -> str:
    return RELEASE_CHANNEL_PREFIX + owner_worker_id


class HandleNotFound(KeyError):
    pass


class HandleNotReady(RuntimeError):
    pass


class HandleExists(RuntimeError):
    """A handle with this id is registered already (another request's, or a retry's)."""


class HandleStore:
    def __init__(self, redis: aioredis.Redis):
        self._redis = redis
        self._register = redis.register_script(_REGISTER)
        self._claim = redis.register_script(_CLAIM)

    async def register(self, handle: kvbroker_pb2.KvHandle, lease_s: float) -> kvbroker_pb2.KvHandle:
        """Stores a READY handle; raises HandleExists if the id is registered (never overwrites it)."""
        stored = kvbroker_pb2.KvHandle()
        stored.CopyFrom(handle)
        stored.state = kvbroker_pb2.HANDLE_STATE_READY
        stored.lease_expires_at = time.time() + lease_s
        created = await self._register(keys=[handle_key(handle.handle_id)], args=[
            stored.SerializeToString(), handle.owner_worker_id, max(1, int(lease_s * 1000))])
        if not created:
            raise HandleExists(handle.handle_id)
        return stored

    async def claim(self, handle_id: str, claimant: str, lease_s: float) -> kvbroker_pb2.KvHandle:
        result = await self._claim(keys=[handle_key(handle_id)], args=[int(lease_s * 1000)])
        if result == 0:
            raise HandleNotFound(handle_id)
        if result == 1:
            raise HandleNotReady(handle_id)
        handle = kvbroker_pb2.KvHandle.FromString(result)
        handle.state = kvbroker_pb2.HANDLE_STATE_CLAIMED
        handle.claimed_by = claimant
        handle.lease_expires_at = time.time() + lease_s
        return handle

    async def release(self, handle_id: str) -> bool:
        """Deletes the handle and tells its owner; False when it was already gone."""
        key = handle_key(handle_id)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hget(key, "owner")
            pipe.delete(key)
            owner, deleted = await pipe.execute()
        if owner is not None:
            await self._redis.publish(release_channel(owner.decode()), handle_id)
        return bool(deleted)
