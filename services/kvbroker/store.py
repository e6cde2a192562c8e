"""Handle records in Redis.

Key `distserve:kv:<handle_id>` is a hash {handle: KvHandle bytes, state, owner, claimant,
mac} with a TTL equal to the lease. Registering refuses an id that exists and claiming
is atomic (Lua scripts each), so a record is never overwritten and exactly one
decode worker can claim a handle. Releasing deletes the key and publishes the
handle id on the owner's channel `distserve:kv-release:<owner_worker_id>`,
which tells the prefill worker to free the buffer. With a registry key
(distserve.record_signing), `mac` signs the handle bytes under the record's key:
a claim of a record whose MAC is missing or wrong (forged, or rewritten by a Redis
writer without the key) raises HandleForged. The release channels are not signed.

Lifecycle: READY --claim--> CLAIMED --release--> (deleted)
           READY/CLAIMED --lease expires--> (deleted; the owner frees on its own timer)
"""

from __future__ import annotations

import time

import redis.asyncio as aioredis

from distserve.record_signing import KV_HANDLE, RecordSigner, process_signer
from distserve.v1 import kvbroker_pb2

HANDLE_KEY_PREFIX = "distserve:kv:"
RELEASE_CHANNEL_PREFIX = "distserve:kv-release:"

# Creates the record unless the key exists: 1 when created, 0 when the id is taken.
_REGISTER = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], 'handle', ARGV[1], 'state', 'ready', 'owner', ARGV[2], 'mac', ARGV[4])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
"""

# Returns {handle bytes, mac} on success, 0 when missing, 1 when claimed by another. A claimant's repeated
# claim succeeds again (a client moving a claim that had landed to another kvbroker replica must get it).
_CLAIM = """
local state = redis.call('HGET', KEYS[1], 'state')
if not state then return 0 end
if state ~= 'ready' and (ARGV[2] == '' or redis.call('HGET', KEYS[1], 'claimant') ~= ARGV[2]) then return 1 end
redis.call('HSET', KEYS[1], 'state', 'claimed', 'claimant', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return {redis.call('HGET', KEYS[1], 'handle') or '', redis.call('HGET', KEYS[1], 'mac') or ''}
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


class HandleForged(RuntimeError):
    """The handle's record in Redis fails its signature check: forged or rewritten without the key."""


class HandleStore:
    def __init__(self, redis: aioredis.Redis, signer: RecordSigner | None = None):
        """signer: signs registered records and checks claimed ones (default: this process's, from its
        environment: record_signing.process_signer)."""
        self._redis = redis
        self._signer = signer or process_signer()
        self._register = redis.register_script(_REGISTER)
        self._claim = redis.register_script(_CLAIM)

    async def register(self, handle: kvbroker_pb2.KvHandle, lease_s: float) -> kvbroker_pb2.KvHandle:
        """Stores a READY handle; raises HandleExists if the id is registered (never overwrites it)."""
        stored = kvbroker_pb2.KvHandle()
        stored.CopyFrom(handle)
        stored.state = kvbroker_pb2.HANDLE_STATE_READY
        stored.lease_expires_at = time.time() + lease_s
        key, payload = handle_key(handle.handle_id), stored.SerializeToString()
        created = await self._register(keys=[key], args=[
            payload, handle.owner_worker_id, max(1, int(lease_s * 1000)),
            self._signer.mac(KV_HANDLE, key, payload) or ""])
        if not created:
            raise HandleExists(handle.handle_id)
        return stored

    async def claim(self, handle_id: str, claimant: str, lease_s: float) -> kvbroker_pb2.KvHandle:
        """The READY handle (or one `claimant` claimed before), now CLAIMED by `claimant` for lease_s. Raises
        HandleNotFound, HandleNotReady (another claimed it) or HandleForged (its signature fails: the caller
        must not use it; the record stays claimed)."""
        result = await self._claim(keys=[handle_key(handle_id)], args=[int(lease_s * 1000), claimant])
        if result == 0:
            raise HandleNotFound(handle_id)
        if result == 1:
            raise HandleNotReady(handle_id)
        payload, mac = result
        if not self._signer.accepts(KV_HANDLE, handle_key(handle_id), payload, mac):
            raise HandleForged(handle_id)
        handle = kvbroker_pb2.KvHandle.FromString(payload)
        handle.state = kvbroker_pb2.HANDLE_STATE_CLAIMED
        handle.claimed_by = claimant
        handle.lease_expires_at = time.time() + lease_s
        return handle

    async def release(self, handle_id: str) -> bool:
        """Deletes the handle and tells its owner; False when it was already gone. The owner is told
        whatever the record's signature: a Redis writer can publish on its channel anyway (at worst a
        worker frees KV early), and a record rewritten in Redis must not keep the owner's KV held."""
        key = handle_key(handle_id)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hget(key, "owner")
            pipe.delete(key)
            owner, deleted = await pipe.execute()
        if owner is not None:
            await self._redis.publish(release_channel(owner.decode()), handle_id)
        return bool(deleted)
