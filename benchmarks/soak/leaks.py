"""The end-of-run check: every child back up, and nothing leaked (tests.cluster_helpers.leftover_state)."""

from __future__ import annotations

import time

import grpc
import redis

from distserve.launcher import Cluster
from tests.cluster_helpers import is_clean, leftover_state, wait_recovered
from tests.faults.conftest import KV_LEASE_S

CLEAN_TIMEOUT_S = KV_LEASE_S + 10  # KV held for a request that died with Redis or the broker lives a lease


def wait_clean(cluster: Cluster, num_prefill: int, num_decode: int) -> dict:
    """Waits for recovery, then up to CLEAN_TIMEOUT_S for leftover_state to reach zero.

    Returns {"state": the last leftover_state, "leaked": its non-zero entries ({} when clean),
    "clean_after_s": seconds it took (None if never)}."""
    wait_recovered(cluster, num_prefill, num_decode, timeout_s=120)
    started = time.monotonic()
    while True:
        try:
            state = leftover_state(cluster)
        except (grpc.RpcError, redis.ConnectionError) as exc:  # a child still restarting
            state = {"handle_keys": [], "error": repr(exc)}
        if "error" not in state and is_clean(state):
            return {"state": state, "leaked": {}, "clean_after_s": round(time.monotonic() - started, 1)}
        if time.monotonic() - started > CLEAN_TIMEOUT_S:
            return {"state": state, "leaked": {k: v for k, v in state.items() if v}, "clean_after_s": None}
        time.sleep(0.5)


def children_state(cluster: Cluster) -> dict[str, dict]:
    """Per child: whether it runs, its supervisor state and its restarts."""
    return {name: {"up": process.popen.poll() is None and process.state == "running", "state": process.state,
                   "restarts": process.restarts} for name, process in cluster.processes.items()}
