"""One fixture starts the real system: Redis, kvbroker, router, 2 prefill + 2 decode processes.

After every test the system must be clean: no KV handle keys in Redis, no
held KV on prefill workers, no used KV blocks on decode workers.
"""

from __future__ import annotations

import time

import grpc
import pytest
import redis

from distserve.launcher import Cluster, ClusterSpec
from distserve.v1 import colocated_pb2, colocated_pb2_grpc, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from tests.otlp_receiver import OtlpReceiver

WORKER_LEASE_S = 2.0


@pytest.fixture(scope="session")
def otlp_receiver():
    receiver = OtlpReceiver().start()
    yield receiver
    receiver.stop()


@pytest.fixture(scope="session")
def cluster(tiny_model_path, tmp_path_factory, otlp_receiver):
    # Every service exports its spans to the test's OTLP receiver, flushing quickly.
    tracing_env = {"OTEL_EXPORTER_OTLP_ENDPOINT": otlp_receiver.endpoint, "OTEL_EXPORTER_OTLP_INSECURE": "true",
                   "OTEL_BSP_SCHEDULE_DELAY": "100"}
    # float32 explicitly: tests compare tokens with transformers' fp32 output, and `auto` may pick bf16.
    spec = ClusterSpec(
        model=tiny_model_path, num_prefill=2, num_decode=2, gateway_port=0,
        router_port=0, broker_port=0, prefill_base_port=0, decode_base_port=0, redis_port=0, metrics_base_port=0,
        env={**tracing_env, "DISTSERVE_DTYPE": "float32"},
        log_dir=str(tmp_path_factory.mktemp("logs")),
        prefill_args=["--max-batch-tokens", "2048", "--lease-s", str(WORKER_LEASE_S), "--heartbeat-s", "0.5"],
        decode_args=["--kv-cache-mb", "64", "--lease-s", str(WORKER_LEASE_S), "--heartbeat-s", "0.5"],
    )
    cluster = Cluster(spec).start()
    wait_for_workers(cluster, 2, 2)
    yield cluster
    cluster.stop()


def wait_for_workers(cluster: Cluster, num_prefill: int, num_decode: int, timeout_s: float = 30,
                     num_colocated: int = 0) -> None:
    """Waits until the registry lists the workers and the router has had time to read it."""
    client = redis.Redis.from_url(cluster.redis_url)
    deadline = time.monotonic() + timeout_s
    wanted = [num_prefill, num_decode, num_colocated]
    while time.monotonic() < deadline:
        counts = [len(client.keys(f"distserve:worker:{role}:*")) for role in ("prefill", "decode", "colocated")]
        if counts == wanted:
            time.sleep(1.0)  # router refresh interval is 0.5 s
            return
        time.sleep(0.1)
    raise AssertionError(f"registry never showed {wanted} prefill / decode / colocated workers")


def worker_stats(cluster: Cluster, name: str):
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


@pytest.fixture(autouse=True)
def system_is_clean_after(cluster):
    yield
    deadline = time.monotonic() + 5
    while True:
        state = leftover_state(cluster)
        if not state["handle_keys"] and not any(v for k, v in state.items() if k != "handle_keys"):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"system not clean after test: {state}")
        time.sleep(0.1)


@pytest.fixture(scope="session", autouse=True)
def ucx_stopped_at_exit():
    """Tests that move KV in this process stop ucxx's notifier thread at the end, so pytest can exit."""
    yield
    from distserve.transfer import connector

    connector.shutdown("ucx")
