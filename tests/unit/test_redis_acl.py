"""Redis users per role (distserve.redis_acl): the ACL text, and the grants against a real redis-server
running the code each role runs (WorkerRegistry, HandleStore, the release channel, the launcher's PING)."""

from __future__ import annotations

import asyncio
import subprocess

import pytest
import redis
import redis.asyncio as aioredis
from redis.backoff import NoBackoff
from redis.retry import Retry

from distserve import prefix_events, redis_acl
from distserve.launcher import _redis_pongs, find_redis_server, free_port
from distserve.record_signing import RecordSigner
from distserve.registry import SPILLING_KEY, WorkerRecord, WorkerRegistry, lists_now, worker_key
from services.kvbroker.store import HandleStore, release_channel
from tests.unit.conftest import _wait_for_ping
from tests.unit.test_kvbroker_store import kv_handle, next_message

UNSIGNED = RecordSigner(None)
NO_RETRY = Retry(NoBackoff(), 0)  # redis-py retries an AuthenticationError (a ConnectionError) by default


def test_the_acl_turns_the_default_user_off_and_gives_every_role_a_user():
    passwords = redis_acl.make_passwords()
    text = redis_acl.acl_text(passwords)
    lines = text.splitlines()
    assert lines[0].startswith("user default off ") and "+@all" not in lines[0]
    assert [line.split()[1] for line in lines[1:]] == ["launcher", *[r for r in redis_acl.ROLES if r != "launcher"]]
    assert len(set(passwords.values())) == len(redis_acl.ROLES)
    assert all(len(p) >= 32 for p in passwords.values())


def test_the_acl_holds_hashes_not_passwords():
    passwords = redis_acl.make_passwords()
    text = redis_acl.acl_text(passwords)
    assert not any(password in text for password in passwords.values())
    assert text.count(" on #") == len(redis_acl.ROLES)


def test_only_the_launcher_gets_every_command_and_key():
    lines = {line.split()[1]: line for line in redis_acl.acl_text(redis_acl.make_passwords()).splitlines()}
    assert "+@all" in lines["launcher"] and "~*" in lines["launcher"].split()
    for role in set(redis_acl.ROLES) - {"launcher"}:
        words = lines[role].split()
        assert "-@all" in words and "+@all" not in words and "~*" not in words and "&*" not in words
        assert not {"+flushall", "+config", "+keys", "+eval"} & set(words)


def test_without_read_only_keys_the_acl_grants_them_read_write():
    text = redis_acl.acl_text(redis_acl.make_passwords(), read_only_keys=False)
    assert "%R~" not in text and "~distserve:worker:prefill:*" in text


def test_spilling_workers_may_also_publish_colocated_records():
    plain = redis_acl.role_access(spill=False)
    spilling = redis_acl.role_access(spill=True)
    assert "distserve:worker:colocated:*" not in plain["prefill"].read_write_keys
    assert "distserve:worker:colocated:*" in plain["prefill"].read_keys  # prefill lists its KV peers
    for role in ("prefill", "decode"):
        assert {"distserve:worker:colocated:*", "distserve:workers:colocated"} <= set(spilling[role].read_write_keys)


def test_a_missing_password_is_refused_naming_the_role():
    passwords = redis_acl.make_passwords()
    del passwords["kvbroker"]
    with pytest.raises(ValueError, match="kvbroker"):
        redis_acl.acl_text(passwords)


def test_the_role_of_a_module():
    assert redis_acl.role_of_module("services.prefill") == "prefill"
    assert redis_acl.role_of_module("services.router.gateway") == "gateway"
    assert redis_acl.role_of_module("services.kvbroker") == "kvbroker"
    assert redis_acl.role_of_module("tests.some_tool") == "launcher"


def test_the_acl_file_is_private(tmp_path):
    path = tmp_path / "redis.acl"
    path.write_text("old")
    path.chmod(0o644)
    redis_acl.write_private(path, "user default off\n")
    assert path.stat().st_mode & 0o777 == 0o600 and path.read_text() == "user default off\n"


@pytest.fixture(scope="module")
def acl_redis(tmp_path_factory):
    """A redis-server running the launcher's ACL (spilling grants); yields (port, passwords)."""
    passwords, port = redis_acl.make_passwords(), free_port()
    acl = redis_acl.write_private(tmp_path_factory.mktemp("acl") / "redis.acl",
                                  redis_acl.acl_text(passwords, spill=True,
                                                     read_only_keys=redis_acl.server_has_read_only_keys(
                                                         find_redis_server())))
    process = subprocess.Popen([find_redis_server(), "--port", str(port), "--bind", "127.0.0.1", "--aclfile",
                                str(acl), "--save", "", "--appendonly", "no"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for_ping(redis_acl.role_url("launcher", passwords["launcher"], port), process)
        yield port, passwords
    finally:
        process.terminate()
        process.wait(timeout=10)


@pytest.fixture
async def clients(acl_redis):
    """An asyncio client per role, on a flushed database."""
    port, passwords = acl_redis
    made = {role: aioredis.from_url(redis_acl.role_url(role, passwords[role], port)) for role in redis_acl.ROLES}
    await made["launcher"].flushall()
    yield made
    await asyncio.gather(*(client.aclose() for client in made.values()))


def record(role: str, worker_id: str) -> WorkerRecord:
    return WorkerRecord(worker_id, role, "127.0.0.1:1", load={"num_waiting": 0})


def test_a_client_without_credentials_can_run_nothing(acl_redis):
    port, _ = acl_redis
    client = redis.Redis(port=port, protocol=2, retry=NO_RETRY)  # RESP2: no HELLO
    for command in (client.ping, lambda: client.get("x"), lambda: client.set("x", 1), lambda: client.keys("*")):
        with pytest.raises(redis.AuthenticationError, match="Authentication required"):
            command()
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=port, username="prefill", password="wrong", retry=NO_RETRY).ping()


def test_the_launchers_ping_authenticates(acl_redis):
    port, passwords = acl_redis
    assert _redis_pongs(port, "launcher", passwords["launcher"])
    assert not _redis_pongs(port)
    assert not _redis_pongs(port, "launcher", "wrong")


@pytest.mark.parametrize("role", redis_acl.WORKER_ROLES)
async def test_a_worker_publishes_and_removes_its_own_record_only(clients, role):
    registry = WorkerRegistry(clients[role], lease_s=5, signer=UNSIGNED)
    await registry.publish(record(role, "w1"))
    assert [r.worker_id for r in await WorkerRegistry(clients["router"], 0, UNSIGNED).list(role)] == ["w1"]
    await registry.remove(role, "w1")
    other = "decode" if role != "decode" else "prefill"
    if role in ("decode", "prefill") and not redis_acl.server_has_read_only_keys(find_redis_server()):
        await registry.publish(record(other, "forged"))  # Redis 6 grants the keys a worker reads read-write
        return
    with pytest.raises(redis.exceptions.NoPermissionError):
        await registry.publish(record(other, "forged"))


async def test_spilling_workers_publish_colocated_records(clients):
    for role in ("prefill", "decode"):
        await WorkerRegistry(clients[role], lease_s=5, signer=UNSIGNED).publish(record("colocated", role))


async def test_a_decode_worker_lists_prefill_workers(clients):
    await WorkerRegistry(clients["prefill"], lease_s=5, signer=UNSIGNED).publish(record("prefill", "p1"))
    listed = await WorkerRegistry(clients["decode"], lease_s=5, signer=UNSIGNED).list("prefill")
    assert [r.worker_id for r in listed] == ["p1"]
    if not redis_acl.server_has_read_only_keys(find_redis_server()):
        await clients["decode"].set(worker_key("prefill", "p1"), "{}")  # Redis 6: read keys are read-write
        return
    with pytest.raises(redis.exceptions.NoPermissionError):
        await clients["decode"].set(worker_key("prefill", "p1"), "{}")


async def test_a_prefill_worker_lists_its_kv_peers_decode_and_colocated_workers(clients):
    for role in ("decode", "colocated"):
        await WorkerRegistry(clients[role], lease_s=5, signer=UNSIGNED).publish(record(role, f"{role}-1"))
        listed = await WorkerRegistry(clients["prefill"], lease_s=5, signer=UNSIGNED).list(role)
        assert [r.worker_id for r in listed] == [f"{role}-1"]
    if redis_acl.server_has_read_only_keys(find_redis_server()):
        with pytest.raises(redis.exceptions.NoPermissionError):
            await clients["prefill"].set(worker_key("decode", "decode-1"), "{}")


async def test_routers_and_gateways_read_workers_and_only_routers_mark_spilling(clients):
    for role in redis_acl.WORKER_ROLES:
        await WorkerRegistry(clients[role], lease_s=5, signer=UNSIGNED).publish(record(role, "w1"))
    for reader in ("router", "gateway"):
        registry = WorkerRegistry(clients[reader], lease_s=0, signer=UNSIGNED)
        for role in redis_acl.WORKER_ROLES:
            assert [r.worker_id for r in await registry.list(role)] == ["w1"]
        if redis_acl.server_has_read_only_keys(find_redis_server()):
            with pytest.raises(redis.exceptions.NoPermissionError):
                await clients[reader].set(worker_key("prefill", "w1"), "{}")
    await WorkerRegistry(clients["router"], lease_s=0, signer=UNSIGNED).mark_spilling(1.0)
    with pytest.raises(redis.exceptions.NoPermissionError):
        await WorkerRegistry(clients["gateway"], lease_s=0, signer=UNSIGNED).mark_spilling(1.0)


async def test_routers_read_and_set_the_registrys_data_epoch(clients):
    epoch = await WorkerRegistry(clients["router"], lease_s=0, signer=UNSIGNED).data_epoch()
    assert epoch == await WorkerRegistry(clients["router"], lease_s=0, signer=UNSIGNED).data_epoch()


async def test_the_kvbroker_keeps_handles_and_tells_their_owner(clients):
    store = HandleStore(clients["kvbroker"], UNSIGNED)
    async with clients["prefill"].pubsub() as pubsub:
        await pubsub.subscribe(release_channel("prefill-a"))
        await store.register(kv_handle("h1", owner="prefill-a"), lease_s=5)
        await store.claim("h1", claimant="decode-b", lease_s=5)
        assert await store.release("h1")
        message = await next_message(pubsub)
        assert message is not None and message["data"] == b"h1"
    for role in ("prefill", "decode", "router", "gateway", "colocated"):
        with pytest.raises(redis.exceptions.NoPermissionError):
            await clients[role].hset("distserve:kv:h2", "state", "ready")


async def test_no_role_but_the_launcher_may_flush_configure_or_list_keys(clients):
    for role in set(redis_acl.ROLES) - {"launcher"}:
        client = clients[role]
        for command in (client.flushall, lambda: client.config_get("*"), lambda: client.keys("*"),
                        lambda: client.eval("return 1", 0)):
            with pytest.raises(redis.exceptions.NoPermissionError):
                await command()
    assert await clients["launcher"].keys("*") == []


def test_the_launchers_control_placement_reads_the_registry(acl_redis):
    port, passwords = acl_redis
    client = redis.Redis.from_url(redis_acl.role_url("launcher", passwords["launcher"], port))
    try:
        assert lists_now(client, redis_acl.WORKER_ROLES, UNSIGNED) == (False, {r: [] for r in redis_acl.WORKER_ROLES})
        assert client.exists(SPILLING_KEY) == 0
    finally:
        client.close()


async def test_workers_append_prefix_events_and_only_routers_read_them(clients):
    for role in redis_acl.WORKER_ROLES:
        await clients[role].xadd(prefix_events.STREAM_KEY, {"w": role, "c": "prefill", "op": "0", "k": b""})
    replies = await clients["router"].xread({prefix_events.STREAM_KEY: "0-0"})
    assert [fields[b"w"] for _, entries in replies for _, fields in entries] == [b"prefill", b"decode", b"colocated"]
    for role in ("gateway", "kvbroker"):
        with pytest.raises(redis.exceptions.NoPermissionError):
            await clients[role].xread({prefix_events.STREAM_KEY: "0-0"})
    with pytest.raises(redis.exceptions.NoPermissionError):
        await clients["router"].xadd(prefix_events.STREAM_KEY, {"w": "forged"})
