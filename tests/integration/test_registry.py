"""Workers live in the registry under a lease: a killed worker leaves it and is not chosen again."""

from __future__ import annotations

import time

import redis

from distserve.launcher import free_port
from tests.builders import generate, token_request
from tests.integration.conftest import WORKER_LEASE_S, wait_for_workers


def registered(cluster, role: str) -> set[str]:
    client = redis.Redis.from_url(cluster.redis_url)
    return {k.decode().rpartition(":")[2] for k in client.keys(f"distserve:worker:{role}:*")}


def start_spares(cluster) -> set[str]:
    """Starts one extra prefill and decode worker; returns their worker ids."""
    args = ["--lease-s", str(WORKER_LEASE_S), "--heartbeat-s", "0.5"]
    ids = set()
    for role, extra in (("prefill", []), ("decode", ["--kv-cache-mb", "16"])):
        port = free_port()
        process = cluster.start_service(f"{role}-spare", f"services.{role}", f"127.0.0.1:{port}", args + extra)
        cluster.wait_healthy(process, 120)
        ids.add(f"{role}-127.0.0.1-{port}")
    wait_for_workers(cluster, 3, 3)
    return ids


def test_killed_workers_leave_registry_and_are_not_chosen(cluster):
    spare_ids = start_spares(cluster)
    assert spare_ids <= registered(cluster, "prefill") | registered(cluster, "decode")

    killed_at = time.monotonic()
    for name in ("prefill-spare", "decode-spare"):
        cluster.kill(name)  # SIGKILL: no graceful deregistration
        del cluster.processes[name]
    while spare_ids & (registered(cluster, "prefill") | registered(cluster, "decode")):
        assert time.monotonic() - killed_at < WORKER_LEASE_S + 1.0, "a killed worker outlived its lease"
        time.sleep(0.05)
    time.sleep(1.0)  # let the router re-read the registry

    for i in range(6):
        answer = generate(cluster.router_address, token_request([20 + i, 21, 22], max_tokens=3))
        chosen = {answer.messages[0].prefill_worker, answer.messages[0].decode_worker}
        assert not chosen & spare_ids, chosen
        assert len(answer.token_ids) == 3


def test_graceful_stop_deregisters_at_once(cluster):
    spare_ids = start_spares(cluster)
    spares = [cluster.processes.pop(name) for name in ("prefill-spare", "decode-spare")]
    try:
        for spare in spares:
            spare.popen.terminate()  # SIGTERM: deregister, drain, exit
        for spare in spares:
            assert spare.popen.wait(timeout=30) == 0, f"{spare.name} did not exit cleanly:\n{spare.log_tail()}"
        assert not spare_ids & (registered(cluster, "prefill") | registered(cluster, "decode"))
    finally:
        for spare in spares:
            if spare.popen.poll() is None:
                spare.popen.kill()


async def test_a_lapsed_lease_is_reported_for_a_while_and_a_deregistration_is_not():
    """list_and_lapsed, on a real Redis: a worker that stopped heartbeating is lapsed (every router's
    refresh sees it), one that deregistered is simply gone, one heartbeating again is live again."""
    import asyncio

    from distserve import redis_client
    from distserve.registry import WorkerRecord, WorkerRegistry
    from tests.integration.test_redis_client import start_redis

    port = free_port()
    process = start_redis(port)
    client = redis_client.connect(f"redis://127.0.0.1:{port}/0")
    try:
        registry = WorkerRegistry(client, lease_s=0.3)
        for worker_id in ("hung", "leaving", "healthy"):
            await registry.publish(WorkerRecord(worker_id, "prefill", f"{worker_id}:1"))
        await registry.remove("prefill", "leaving")
        await asyncio.sleep(0.5)
        await registry.publish(WorkerRecord("healthy", "prefill", "healthy:1"))
        live, lapsed = await registry.list_and_lapsed("prefill")
        assert [w.worker_id for w in live] == ["healthy"] and lapsed == {"hung"}
        assert (await registry.list_and_lapsed("prefill"))[1] == {"hung"}, "seen by the next refresh too"
        await registry.publish(WorkerRecord("hung", "prefill", "hung:1"))  # back
        live, lapsed = await registry.list_and_lapsed("prefill")
        assert sorted(w.worker_id for w in live) == ["healthy", "hung"] and not lapsed
    finally:
        await client.aclose()
        process.kill()
