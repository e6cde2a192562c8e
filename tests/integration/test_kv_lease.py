"""KV held on a prefill worker: freed when its lease ends unclaimed (the Redis record and the buffer),
kept under the worker's byte cap (RESOURCE_EXHAUSTED past it), and never under an id already taken
(ALREADY_EXISTS, at the worker and at the broker)."""

from __future__ import annotations

import json
import time

import grpc
import pytest
import redis
import torch

from distserve.model_spec import load_model_spec
from distserve.launcher import free_port
from distserve.v1 import kvbroker_pb2, kvbroker_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from tests.builders import sampling
from tests.integration.conftest import worker_stats

LEASE_S = 1.0
CAP_TOKENS = 100  # the capped worker holds at most this many tokens' KV


def start_prefill(cluster, name: str, args: list[str]):
    # Not in the router's registry view for long: a worker that only this module's tests call.
    process = cluster.start_service(name, "services.prefill", f"127.0.0.1:{free_port()}",
                                    args + ["--heartbeat-s", "0.5", "--lease-s", "2"])
    cluster.wait_healthy(process, 120)
    return process


def stop_prefill(cluster, name: str) -> None:
    process = cluster.processes.pop(name)
    process.popen.terminate()
    process.popen.wait(timeout=30)


def prefill(process, num_tokens: int, handle_id: str = "", request_id: str = "held-kv-test"):
    with grpc.insecure_channel(process.address) as channel:
        return prefill_pb2_grpc.PrefillServiceStub(channel).Prefill(prefill_pb2.PrefillRequest(
            request_id=request_id, prompt_token_ids=list(range(10, 10 + num_tokens)), kv_handle_id=handle_id,
            kv_secret="held-kv-test-secret", sampling=sampling(max_tokens=8, ignore_eos=True)), timeout=60)


def release(cluster, handle_id: str) -> None:
    with grpc.insecure_channel(cluster.broker_address) as channel:
        kvbroker_pb2_grpc.KvBrokerServiceStub(channel).ReleaseHandle(
            kvbroker_pb2.ReleaseHandleRequest(handle_id=handle_id, reason="test done"), timeout=10)


def wait_held(cluster, name: str, num_held: int, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while worker_stats(cluster, name).num_held_handles != num_held:
        assert time.monotonic() < deadline, f"{name} never held {num_held} handles"
        time.sleep(0.05)


def published_load(cluster, process, until, timeout_s: float = 5.0) -> dict:
    """The load the worker publishes in the registry, once `until(load)` holds (heartbeats refresh it)."""
    client = redis.Redis.from_url(cluster.redis_url)
    key = f"distserve:worker:prefill:prefill-127.0.0.1-{process.address.rpartition(':')[2]}"
    deadline = time.monotonic() + timeout_s
    while True:
        load = json.loads(client.get(key))["load"]
        if until(load) or time.monotonic() > deadline:
            return load
        time.sleep(0.1)


def test_unclaimed_handle_expires_with_its_lease(cluster):
    process = start_prefill(cluster, "prefill-lease", ["--kv-lease-s", str(LEASE_S)])
    try:
        reply = prefill(process, 50, request_id="lease-test")
        client = redis.Redis.from_url(cluster.redis_url)
        key = f"distserve:kv:{reply.kv_handle_id}"
        assert client.exists(key) and worker_stats(cluster, "prefill-lease").num_held_handles == 1
        assert 0 < client.pttl(key) <= LEASE_S * 1000
        deadline = time.monotonic() + LEASE_S + 2.5  # lease, plus the worker's 1 s expiry sweep
        while client.exists(key) or worker_stats(cluster, "prefill-lease").num_held_handles:
            assert time.monotonic() < deadline, "unclaimed KV outlived its lease"
            time.sleep(0.1)
    finally:
        stop_prefill(cluster, "prefill-lease")


@pytest.fixture(scope="module")
def capped(cluster, tiny_model_path):
    """A prefill worker that may hold CAP_TOKENS tokens' KV (float32), and that cap in bytes."""
    cap = CAP_TOKENS * load_model_spec(tiny_model_path).kv_bytes_per_token(torch.float32)
    process = start_prefill(cluster, "prefill-capped", ["--max-held-kv-bytes", str(cap), "--kv-lease-s", "60"])
    yield process, cap
    stop_prefill(cluster, "prefill-capped")


def test_prefill_past_the_held_kv_cap_fails_fast_until_kv_is_released(cluster, capped):
    process, cap = capped
    first = prefill(process, 60)
    try:
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as refused:
            prefill(process, 60)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"held KV is full: {first.kv_layout.num_bytes} bytes held, cap {cap}" in refused.value.details()
        assert time.monotonic() - started < 2.0, "refused before the forward, not after"
        stats = worker_stats(cluster, "prefill-capped")
        assert stats.num_held_handles == 1 and stats.held_bytes == first.kv_layout.num_bytes
        load = published_load(cluster, process, until=lambda load: load["held_bytes"] > 0)
        assert load["held_bytes"] == first.kv_layout.num_bytes and load["max_held_bytes"] == cap
    finally:
        release(cluster, first.kv_handle_id)
    wait_held(cluster, "prefill-capped", 0)
    release(cluster, prefill(process, 60).kv_handle_id)  # room again once released
    wait_held(cluster, "prefill-capped", 0)


def test_a_handle_id_already_taken_is_refused_and_the_first_kv_kept(cluster, capped):
    process, _ = capped
    first = prefill(process, 20, handle_id="dup-handle-1")
    try:
        with pytest.raises(grpc.RpcError) as taken:
            prefill(process, 30, handle_id="dup-handle-1")
        assert taken.value.code() == grpc.StatusCode.ALREADY_EXISTS and "dup-handle-1" in taken.value.details()
        stats = worker_stats(cluster, "prefill-capped")
        assert stats.num_held_handles == 1 and stats.held_bytes == first.kv_layout.num_bytes

        handle = kvbroker_pb2.KvHandle(handle_id="dup-handle-1", owner_worker_id="prefill-elsewhere",
                                       owner_ucx_address="127.0.0.1:1", layout=first.kv_layout)
        with grpc.insecure_channel(cluster.broker_address) as channel, pytest.raises(grpc.RpcError) as exists:
            kvbroker_pb2_grpc.KvBrokerServiceStub(channel).RegisterHandle(
                kvbroker_pb2.RegisterHandleRequest(handle=handle, lease_s=30), timeout=10)
        assert exists.value.code() == grpc.StatusCode.ALREADY_EXISTS
        record = redis.Redis.from_url(cluster.redis_url).hgetall("distserve:kv:dup-handle-1")
        assert record[b"owner"].decode().startswith("prefill-127.0.0.1-"), "the first owner's record is kept"
    finally:
        release(cluster, "dup-handle-1")
    wait_held(cluster, "prefill-capped", 0)
