"""A KV handle nobody claims is freed when its lease ends: the Redis record and the prefill buffer."""

from __future__ import annotations

import time

import grpc
import redis

from distserve.launcher import free_port
from distserve.v1 import prefill_pb2, prefill_pb2_grpc
from tests.builders import sampling
from tests.integration.conftest import worker_stats

LEASE_S = 1.0


def test_unclaimed_handle_expires_with_its_lease(cluster):
    port = free_port()
    # Not in the router's registry view for long: a lease-test worker that only this test calls.
    process = cluster.start_service("prefill-lease", "services.prefill", f"127.0.0.1:{port}",
                                    ["--kv-lease-s", str(LEASE_S), "--heartbeat-s", "0.5", "--lease-s", "2"])
    try:
        cluster.wait_healthy(process, 120)
        with grpc.insecure_channel(process.address) as channel:
            reply = prefill_pb2_grpc.PrefillServiceStub(channel).Prefill(prefill_pb2.PrefillRequest(
                request_id="lease-test", prompt_token_ids=list(range(10, 60)),
                sampling=sampling(max_tokens=8, ignore_eos=True)), timeout=60)
        client = redis.Redis.from_url(cluster.redis_url)
        key = f"distserve:kv:{reply.kv_handle_id}"
        assert client.exists(key) and worker_stats(cluster, "prefill-lease").num_held_handles == 1
        assert 0 < client.pttl(key) <= LEASE_S * 1000
        deadline = time.monotonic() + LEASE_S + 2.5  # lease, plus the worker's 1 s expiry sweep
        while client.exists(key) or worker_stats(cluster, "prefill-lease").num_held_handles:
            assert time.monotonic() < deadline, "unclaimed KV outlived its lease"
            time.sleep(0.1)
    finally:
        process.popen.terminate()
        process.popen.wait(timeout=30)
        del cluster.processes["prefill-lease"]
