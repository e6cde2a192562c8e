"""Helpers shared by the fixtures that start a real system (tests/integration, tests/faults).

`leftover_state` is the leak check: after a test, no KV handle keys in Redis (the
kvbroker's handles), no held KV on prefill workers, no used KV blocks on decode
or colocated workers. `assert_clean` waits a few seconds for it to reach zero.
"""

from __future__ import annotations

import contextlib
import time
import urllib.request
from typing import Callable, Iterator

import grpc
import redis

from distserve.launcher import Cluster, ClusterSpec
from distserve.record_signing import KV_HANDLE, sign
from distserve.v1 import (colocated_pb2, colocated_pb2_grpc, decode_pb2, decode_pb2_grpc, kvbroker_pb2,
                          kvbroker_pb2_grpc, lifecycle_pb2, lifecycle_pb2_grpc, prefill_pb2, prefill_pb2_grpc)
from tests.builders import sampling

WORKER_LEASE_S = 2.0
# Short leases and heartbeats, so tests see a worker leave or return within seconds.
PREFILL_TEST_ARGS = ["--max-batch-tokens", "2048", "--lease-s", str(WORKER_LEASE_S), "--heartbeat-s", "0.5"]
DECODE_TEST_ARGS = ["--kv-cache-mb", "64", "--lease-s", str(WORKER_LEASE_S), "--heartbeat-s", "0.5"]


def wait_for_workers(cluster: Cluster, num_prefill: int, num_decode: int, timeout_s: float = 30,
                     num_colocated: int = 0) -> None:
    """Waits until the registry lists the workers and the router has had time to read it."""
    wait_for_registry(cluster.redis_url, {"prefill": num_prefill, "decode": num_decode, "colocated": num_colocated},
                      timeout_s)


def wait_for_registry(redis_url: str, wanted: dict[str, int], timeout_s: float,
                      still_alive: Callable[[], None] = lambda: None) -> None:
    """Until the registry lists `wanted` workers per role, and a router has had time to read it; calls
    still_alive between looks (it raises to give up early, e.g. when a process died)."""
    client = redis.Redis.from_url(redis_url)
    deadline = time.monotonic() + timeout_s
    counts = None
    while time.monotonic() < deadline:
        try:
            counts = {role: len(client.keys(f"distserve:worker:{role}:*")) for role in wanted}
        except redis.ConnectionError:
            counts = None  # Redis restarting
        if counts == wanted:
            time.sleep(1.0)  # router refresh interval is 0.5 s
            return
        still_alive()
        time.sleep(0.1)
    raise AssertionError(f"the registry never listed {wanted} (last: {counts})")


def prefill_with_secret(cluster: Cluster, name: str, prompt: list[int], secret: str) -> prefill_pb2.PrefillResponse:
    """Prefills `prompt` on worker `name` straight (no router): its KV is held for pullers presenting `secret`."""
    with grpc.insecure_channel(cluster.processes[name].address) as channel:
        return prefill_pb2_grpc.PrefillServiceStub(channel).Prefill(prefill_pb2.PrefillRequest(
            request_id="pull-secret-test", prompt_token_ids=prompt, kv_secret=secret,
            sampling=sampling(max_tokens=4, ignore_eos=True)), timeout=60)


def decode_with_secret(cluster: Cluster, name: str, prompt: list[int], reply: prefill_pb2.PrefillResponse,
                       secret: str) -> list[int]:
    """Decodes a prefilled prompt on worker `name` straight (no router), presenting `secret` for its KV."""
    with grpc.insecure_channel(cluster.processes[name].address) as channel:
        messages = decode_pb2_grpc.DecodeServiceStub(channel).Decode(decode_pb2.DecodeRequest(
            request_id=reply.request_id, kv_handle_id=reply.kv_handle_id, prompt_token_ids=prompt,
            first_token_id=reply.first_token_id, sampling=sampling(max_tokens=4, ignore_eos=True),
            kv_secret=secret), timeout=60)
        return [t for m in messages for t in m.token_ids]


def release_handle(cluster: Cluster, handle_id: str) -> None:
    """Releases a KV handle at the kvbroker (its owner frees the KV), as the router does after a request."""
    with grpc.insecure_channel(cluster.broker_address) as channel:
        kvbroker_pb2_grpc.KvBrokerServiceStub(channel).ReleaseHandle(
            kvbroker_pb2.ReleaseHandleRequest(handle_id=handle_id, reason="test done"), timeout=10)


def drain(address: str, grace_s: float = 0.0) -> lifecycle_pb2.DrainResponse:
    """Asks the server at `address` to drain (LifecycleService.Drain), within grace_s if shorter than its own."""
    with grpc.insecure_channel(address) as channel:
        return lifecycle_pb2_grpc.LifecycleServiceStub(channel).Drain(
            lifecycle_pb2.DrainRequest(reason="test", grace_s=grace_s), timeout=10)


def rewrite_handle(cluster: Cluster, handle_id: str, change: Callable[[kvbroker_pb2.KvHandle], None],
                   resign: bool) -> None:
    """Rewrites a KV handle's record in Redis as `change` says. resign: signs it afresh with the children's
    registry key (a writer holding the key); else its MAC stays the old one (a Redis writer without it)."""
    client = redis.Redis.from_url(cluster.redis_url)
    key = f"distserve:kv:{handle_id}"
    handle = kvbroker_pb2.KvHandle.FromString(client.hget(key, "handle"))
    change(handle)
    payload = handle.SerializeToString()
    client.hset(key, "handle", payload)
    if resign:
        client.hset(key, "mac", sign(cluster.registry_key(), KV_HANDLE, key, payload))


def worker_stats(cluster: Cluster, name: str):
    """The stats reply of worker `name` (prefill, decode or colocated)."""
    address = cluster.processes[name].address
    with grpc.insecure_channel(address) as channel:
        if name.startswith("colocated"):
            return colocated_pb2_grpc.ColocatedServiceStub(channel).GetColocatedStats(
                colocated_pb2.GetColocatedStatsRequest(), timeout=10)
        if name.startswith("prefill"):
            return prefill_pb2_grpc.PrefillServiceStub(channel).GetPrefillStats(
                prefill_pb2.GetPrefillStatsRequest(), timeout=10)
        return decode_pb2_grpc.DecodeServiceStub(channel).GetDecodeStats(decode_pb2.GetDecodeStatsRequest(),
                                                                         timeout=10)


def leftover_state(cluster: Cluster) -> dict:
    """KV handle keys in Redis, and per live worker its held handles (prefill) or used blocks (decode)."""
    client = redis.Redis.from_url(cluster.redis_url)
    state = {"handle_keys": [k.decode() for k in client.keys("distserve:kv:*")]}
    for name, process in cluster.processes.items():
        if process.popen.poll() is not None:
            continue
        if name.startswith("prefill"):
            state[name] = worker_stats(cluster, name).num_held_handles
        elif name.startswith(("decode", "colocated")):
            state[name] = worker_stats(cluster, name).num_used_blocks
    return state


def is_clean(state: dict) -> bool:
    return not state["handle_keys"] and not any(v for k, v in state.items() if k != "handle_keys")


def assert_clean(cluster: Cluster, timeout_s: float = 5.0) -> None:
    """Waits up to timeout_s for leftover_state to be all zero; raises AssertionError with the state if not."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            state = leftover_state(cluster)
            if is_clean(state):
                return
        except (grpc.RpcError, redis.ConnectionError) as exc:  # a process still restarting
            state = {"error": repr(exc)}
        if time.monotonic() > deadline:
            raise AssertionError(f"system not clean after test: {state}")
        time.sleep(0.1)


def wait_recovered(cluster: Cluster, num_prefill: int, num_decode: int, timeout_s: float = 60,
                   num_colocated: int = 0) -> None:
    """Waits until every child runs, every gRPC service is SERVING, the gateway answers and the registry
    lists the workers: the state a supervised cluster returns to after a restart."""
    deadline = time.monotonic() + timeout_s
    for process in list(cluster.processes.values()):
        while process.popen.poll() is not None:  # the supervisor swaps in a new Popen when it restarts one
            assert time.monotonic() < deadline, f"{process.name} not restarted:\n{process.log_tail()}"
            time.sleep(0.1)
            process = cluster.processes[process.name]
        if process.address:
            cluster.wait_healthy(process, max(1.0, deadline - time.monotonic()))
    if cluster.gateway_url:
        _wait_gateway(cluster.gateway_url, deadline)
    wait_for_workers(cluster, num_prefill, num_decode, timeout_s=max(1.0, deadline - time.monotonic()),
                     num_colocated=num_colocated)


def _wait_gateway(url: str, deadline: float) -> None:
    while True:
        try:
            with urllib.request.urlopen(url + "/version", timeout=1) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        assert time.monotonic() < deadline, f"gateway {url} not answering"
        time.sleep(0.1)


@contextlib.contextmanager
def running_cluster(spec: ClusterSpec, num_prefill: int, num_decode: int, num_colocated: int = 0) -> Iterator[Cluster]:
    """Starts `spec`, waits until its workers are registered, yields it, and stops it whatever happens."""
    cluster = Cluster(spec).start()
    try:
        wait_for_workers(cluster, num_prefill, num_decode, num_colocated=num_colocated)
        yield cluster
    finally:
        cluster.stop()
