"""HandleStore against a real redis-server: register, claim once, release with notification."""

from __future__ import annotations

import asyncio
import time

import pytest

from distserve.record_signing import RecordSigner
from distserve.v1 import common_pb2, kvbroker_pb2
from services.kvbroker.store import (HandleExists, HandleForged, HandleNotFound, HandleNotReady, HandleStore,
                                    handle_key, release_channel)


def kv_handle(handle_id: str = "h1", owner: str = "prefill-a") -> kvbroker_pb2.KvHandle:
    layout = common_pb2.KvLayout(num_layers=2, num_kv_heads=2, head_dim=16, num_tokens=7, dtype="float32",
                                 num_bytes=2 * 2 * 2 * 16 * 7 * 4)
    return kvbroker_pb2.KvHandle(handle_id=handle_id, request_id="req-1", owner_worker_id=owner,
                                 owner_ucx_address="127.0.0.1:7000", layout=layout)


@pytest.fixture
def store(redis_client) -> HandleStore:
    return HandleStore(redis_client)


async def next_message(pubsub, timeout_s: float = 2.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.1)
        if message is not None:
            return message
    return None


async def test_register_stores_a_ready_handle_with_the_lease_as_ttl(store, redis_client):
    before = time.time()
    stored = await store.register(kv_handle(), lease_s=5)

    assert stored.state == kvbroker_pb2.HANDLE_STATE_READY
    assert before + 5 <= stored.lease_expires_at <= time.time() + 5
    assert 4000 < await redis_client.pttl(handle_key("h1")) <= 5000
    fields = await redis_client.hgetall(handle_key("h1"))
    assert fields[b"state"] == b"ready" and fields[b"owner"] == b"prefill-a"


async def test_registering_an_existing_id_is_refused_and_keeps_the_first_record(store, redis_client):
    await store.register(kv_handle(owner="prefill-a"), lease_s=5)
    await store.claim("h1", claimant="decode-b", lease_s=30)
    with pytest.raises(HandleExists):
        await store.register(kv_handle(owner="prefill-z"), lease_s=1)
    fields = await redis_client.hgetall(handle_key("h1"))
    assert fields[b"state"] == b"claimed" and fields[b"owner"] == b"prefill-a", "the first record is untouched"
    assert await redis_client.pttl(handle_key("h1")) > 25_000, "the first record keeps its lease"


async def test_concurrent_registrations_of_one_id_have_one_winner(store, redis_client):
    owners = [f"prefill-{i}" for i in range(8)]
    results = await asyncio.gather(*(store.register(kv_handle(owner=o), 5) for o in owners), return_exceptions=True)
    winners = [o for o, r in zip(owners, results) if isinstance(r, kvbroker_pb2.KvHandle)]
    assert len(winners) == 1 and sum(isinstance(r, HandleExists) for r in results) == 7
    assert await redis_client.hget(handle_key("h1"), "owner") == winners[0].encode()


async def test_an_expired_id_may_be_registered_again(store):
    await store.register(kv_handle(), lease_s=0.2)
    await asyncio.sleep(0.35)
    again = await store.register(kv_handle(owner="prefill-b"), lease_s=5)
    assert again.owner_worker_id == "prefill-b"


async def test_claim_returns_the_handle_and_extends_the_lease(store, redis_client):
    await store.register(kv_handle(), lease_s=1)
    claimed = await store.claim("h1", claimant="decode-b", lease_s=30)

    assert claimed.state == kvbroker_pb2.HANDLE_STATE_CLAIMED and claimed.claimed_by == "decode-b"
    assert (claimed.handle_id, claimed.request_id, claimed.owner_worker_id) == ("h1", "req-1", "prefill-a")
    assert claimed.owner_ucx_address == "127.0.0.1:7000" and claimed.layout == kv_handle().layout
    assert claimed.lease_expires_at > time.time() + 25
    assert await redis_client.pttl(handle_key("h1")) > 25_000
    assert await redis_client.hget(handle_key("h1"), "state") == b"claimed"


async def test_a_handle_can_be_claimed_only_once(store):
    await store.register(kv_handle(), lease_s=5)
    await store.claim("h1", claimant="decode-b", lease_s=5)
    with pytest.raises(HandleNotReady):
        await store.claim("h1", claimant="decode-c", lease_s=5)


async def test_a_claimants_repeated_claim_returns_the_handle_again(store):
    """What a client moving a landed claim to another kvbroker replica sends (distserve.broker_client)."""
    await store.register(kv_handle(), lease_s=5)
    first = await store.claim("h1", claimant="decode-b", lease_s=5)
    again = await store.claim("h1", claimant="decode-b", lease_s=30)
    assert again.handle_id == first.handle_id and again.claimed_by == "decode-b"
    with pytest.raises(HandleNotReady):
        await store.claim("h1", claimant="decode-c", lease_s=5)


async def test_claims_without_a_claimant_are_never_repeated(store):
    await store.register(kv_handle(), lease_s=5)
    await store.claim("h1", claimant="", lease_s=5)
    with pytest.raises(HandleNotReady):
        await store.claim("h1", claimant="", lease_s=5)


async def test_concurrent_claims_have_one_winner(store):
    await store.register(kv_handle(), lease_s=5)
    results = await asyncio.gather(*(store.claim("h1", f"decode-{i}", 5) for i in range(8)), return_exceptions=True)
    assert sum(isinstance(r, kvbroker_pb2.KvHandle) for r in results) == 1
    assert sum(isinstance(r, HandleNotReady) for r in results) == 7


async def test_claim_of_an_unknown_handle_raises_not_found(store):
    with pytest.raises(HandleNotFound):
        await store.claim("nope", claimant="decode-b", lease_s=5)


async def test_release_deletes_and_notifies_the_owner_once(store, redis_client):
    await store.register(kv_handle(owner="prefill-a"), lease_s=5)
    await store.claim("h1", claimant="decode-b", lease_s=5)
    pubsub = redis_client.pubsub()
    await pubsub.subscribe(release_channel("prefill-a"))
    try:
        assert await store.release("h1") is True
        message = await next_message(pubsub)
        assert message is not None and message["data"] == b"h1"
        assert await redis_client.exists(handle_key("h1")) == 0

        assert await store.release("h1") is False
        assert await next_message(pubsub, timeout_s=0.3) is None
    finally:
        await pubsub.aclose()
    with pytest.raises(HandleNotFound):
        await store.claim("h1", claimant="decode-c", lease_s=5)


async def test_release_of_an_unclaimed_handle_also_notifies(store, redis_client):
    await store.register(kv_handle("h2", owner="prefill-z"), lease_s=5)
    pubsub = redis_client.pubsub()
    await pubsub.subscribe(release_channel("prefill-z"))
    try:
        assert await store.release("h2") is True
        message = await next_message(pubsub)
        assert message is not None and message["data"] == b"h2"
    finally:
        await pubsub.aclose()


async def test_an_expired_handle_is_gone(store):
    await store.register(kv_handle(), lease_s=0.2)
    await asyncio.sleep(0.35)
    with pytest.raises(HandleNotFound):
        await store.claim("h1", claimant="decode-b", lease_s=5)
    assert await store.release("h1") is False


KEY = b"kvbroker-test-key-" + b"0" * 32


async def test_a_signed_store_claims_its_own_records_and_refuses_rewritten_or_unsigned_ones(redis_client):
    rejected = []
    store = HandleStore(redis_client, RecordSigner(KEY, rejected.append))
    await store.register(kv_handle("good"), lease_s=5)
    assert (await store.claim("good", claimant="decode-b", lease_s=5)).owner_ucx_address == "127.0.0.1:7000"

    await store.register(kv_handle("moved"), lease_s=5)
    rewritten = kvbroker_pb2.KvHandle.FromString(await redis_client.hget(handle_key("moved"), "handle"))
    rewritten.owner_ucx_address = "10.6.6.6:7000"  # a Redis writer redirecting the pull
    await redis_client.hset(handle_key("moved"), "handle", rewritten.SerializeToString())
    with pytest.raises(HandleForged):
        await store.claim("moved", claimant="decode-b", lease_s=5)

    await HandleStore(redis_client, RecordSigner(None)).register(kv_handle("unsigned"), lease_s=5)
    assert await redis_client.hget(handle_key("unsigned"), "mac") == b""
    with pytest.raises(HandleForged):
        await store.claim("unsigned", claimant="decode-b", lease_s=5)
    assert rejected == ["kv-handle", "kv-handle"]


async def test_a_store_without_a_key_claims_signed_and_unsigned_records_as_before(redis_client):
    await HandleStore(redis_client, RecordSigner(KEY)).register(kv_handle("signed"), lease_s=5)
    unsigned = HandleStore(redis_client, RecordSigner(None))
    await unsigned.register(kv_handle("unsigned"), lease_s=5)
    for handle_id in ("signed", "unsigned"):
        assert (await unsigned.claim(handle_id, claimant="decode-b", lease_s=5)).handle_id == handle_id
