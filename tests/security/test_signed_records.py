"""Records written into Redis by someone without the registry key are ignored by a running system: a
forged worker is never routed to nor dialled, a rewritten KV handle is refused before anything is pulled."""

from __future__ import annotations

import json
import re
import socket
import time
import urllib.request

import grpc
import pytest
import redis

from distserve.record_signing import RecordSigner
from distserve.registry import MAC_FIELD, index_key, lists_now, worker_key
from tests.builders import generate, token_request
from tests.cluster_helpers import (decode_with_secret, prefill_with_secret, release_handle, rewrite_handle,
                                   worker_stats)

ROLES = ("prefill", "decode", "colocated")
PLANTED_S = 60  # a forged record's lease: it outlives the test, which deletes it
SECRET = "security-test-kv-secret"
# The load that wins every pick (fewest prompt tokens ahead, most free blocks), were the record believed.
ATTRACTIVE = {"outstanding_tokens": -10**6, "num_running": 0, "num_waiting": 0, "free_blocks": 10**6,
              "total_blocks": 10**6}


class Trap:
    """A TCP listener on a free loopback port that never answers: the address a forged record names."""

    def __init__(self):
        self._socket = socket.create_server(("127.0.0.1", 0), backlog=64)
        self._socket.setblocking(False)
        self.address = f"127.0.0.1:{self._socket.getsockname()[1]}"
        self._num_connections = 0

    def num_connections(self) -> int:
        """Connections made to it so far (the kernel completes them without an accept)."""
        while True:
            try:
                connection, _ = self._socket.accept()
            except BlockingIOError:
                return self._num_connections
            connection.close()
            self._num_connections += 1

    def close(self) -> None:
        self._socket.close()


@pytest.fixture
def traps():
    made = [Trap(), Trap()]
    yield made
    for trap in made:
        trap.close()


def real_record(client: redis.Redis, role: str) -> dict:
    (key,) = client.keys(f"distserve:worker:{role}:*")
    return json.loads(client.get(key))


def plant_worker(client: redis.Redis, planted: dict, role: str, record: dict) -> str:
    """Writes `record` into Redis as a live worker of `role`, listed in its index; returns its key."""
    key, index = worker_key(role, record["worker_id"]), index_key(role)
    seconds, _ = client.time()
    client.set(key, json.dumps(record), ex=PLANTED_S)
    client.zadd(index, {record["worker_id"]: seconds + PLANTED_S})
    planted[key] = index
    return key


def rejected(metrics_url: str, kind: str) -> float:
    """distserve:registry_records_rejected_total{kind} as a service exports it (0 before any)."""
    with urllib.request.urlopen(metrics_url, timeout=10) as reply:
        text = reply.read().decode()
    found = re.search(rf'^distserve:registry_records_rejected_total{{kind="{kind}"}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def forge_workers(client: redis.Redis, planted: dict, traps: list[Trap]) -> dict[str, list[str]]:
    """Per role, two forged copies of the real worker's record, at the traps' addresses and a load that wins
    every pick: one
    without a MAC, one with the real record's MAC. Returns their keys by role."""
    grpc_trap, ucx_trap = traps
    keys: dict[str, list[str]] = {"prefill": [], "decode": []}
    for role in keys:
        real = real_record(client, role)
        assert len(real[MAC_FIELD]) == 64, "a system started as `distserve up` starts it signs its records"
        for host, mac in (("127.0.0.2", None), ("127.0.0.3", real[MAC_FIELD])):
            fields = {name: value for name, value in real.items() if name != MAC_FIELD}
            fields.update(worker_id=f"{role}-{host}-{grpc_trap.address.rpartition(':')[2]}",
                          address=grpc_trap.address, ucx_address=ucx_trap.address, load={**real["load"], **ATTRACTIVE})
            keys[role].append(plant_worker(client, planted, role, {**fields, **({MAC_FIELD: mac} if mac else {})}))
    return keys


def test_forged_worker_records_are_never_listed_routed_to_or_dialled(signed_cluster, planted, traps):
    cluster = signed_cluster
    client = redis.Redis.from_url(cluster.redis_url)
    real_ids = {real_record(client, role)["worker_id"] for role in ("prefill", "decode")}
    forged = forge_workers(client, planted, traps)
    forged_ids = {key.rpartition(":")[2] for keys in forged.values() for key in keys}

    # Valid-looking and live: a reader without the key lists them; only the signature keeps them out.
    _, unchecked = lists_now(client, ROLES, RecordSigner(None))
    assert forged_ids <= {w.worker_id for role in ROLES for w in unchecked[role]}
    _, checked = lists_now(client, ROLES, RecordSigner(cluster.registry_key()))
    assert {w.worker_id for role in ROLES for w in checked[role]} == real_ids

    time.sleep(4 * 0.5)  # the router re-reads the registry every 0.5 s, the decode worker (its UCX peers) too
    for i in range(6):
        answer = generate(cluster.router_address, token_request([30 + i, 31, 32], max_tokens=3))
        assert len(answer.token_ids) == 3
        assert {answer.messages[0].prefill_worker, answer.messages[0].decode_worker} == real_ids
    assert [trap.num_connections() for trap in traps] == [0, 0], "a forged address was dialled"

    router_log = cluster.processes["router"].log_path.read_text()
    decode_log = cluster.processes["decode-0"].log_path.read_text()  # it reads prefill records, to dial them
    for key in forged["prefill"] + forged["decode"]:
        assert router_log.count(f"ignoring {key}:") == 1, "logged once per record, not at every refresh"
    for key in forged["prefill"]:
        assert decode_log.count(f"ignoring {key}:") == 1
    assert rejected(cluster.processes["router"].metrics_url, "worker") >= 4


def redirect_holder(trap: Trap):
    def change(handle) -> None:
        handle.owner_ucx_address = trap.address
    return change


def halve_layout(trap: Trap):
    def change(handle) -> None:
        handle.layout.num_tokens //= 2
        handle.layout.num_bytes //= 2
    return change


@pytest.mark.parametrize("rewrite", [redirect_holder, halve_layout], ids=["holder", "layout"])
def test_a_handle_rewritten_in_redis_is_refused_and_nothing_is_pulled(signed_cluster, traps, rewrite):
    cluster = signed_cluster
    prompt = list(range(20, 80))
    received = worker_stats(cluster, "decode-0").kv_transfers_received
    counted = rejected(cluster.processes["kvbroker"].metrics_url, "kv-handle")
    reply = prefill_with_secret(cluster, "prefill-0", prompt, SECRET)
    try:
        rewrite_handle(cluster, reply.kv_handle_id, rewrite(traps[0]), resign=False)
        with pytest.raises(grpc.RpcError) as refused:
            decode_with_secret(cluster, "decode-0", prompt, reply, SECRET)
    finally:
        release_handle(cluster, reply.kv_handle_id)  # its owner frees the KV
    assert refused.value.code() == grpc.StatusCode.DATA_LOSS
    assert "fails its signature check" in refused.value.details()
    assert traps[0].num_connections() == 0
    assert worker_stats(cluster, "decode-0").kv_transfers_received == received, "nothing was pulled"
    assert rejected(cluster.processes["kvbroker"].metrics_url, "kv-handle") == counted + 1


def test_the_same_rewrite_signed_with_the_key_is_followed_so_the_trap_would_see_a_pull(signed_cluster, traps):
    """The control for the test above: a holder address re-signed with the deployment's key (a writer who
    has it) is trusted, and the decode worker dials it."""
    cluster = signed_cluster
    prompt = list(range(20, 80))
    reply = prefill_with_secret(cluster, "prefill-0", prompt, SECRET)
    try:
        rewrite_handle(cluster, reply.kv_handle_id, redirect_holder(traps[0]), resign=True)
        with pytest.raises(grpc.RpcError) as failed:
            decode_with_secret(cluster, "decode-0", prompt, reply, SECRET)
    finally:
        release_handle(cluster, reply.kv_handle_id)
    assert failed.value.code() == grpc.StatusCode.DATA_LOSS and "signature" not in failed.value.details()
    assert traps[0].num_connections() >= 1
