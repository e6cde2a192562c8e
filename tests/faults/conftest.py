"""`faults_cluster`: a real, supervised system for fault tests, one per test module.

Redis, kvbroker, router, 2 prefill + 2 decode workers and the HTTP gateway run as
OS processes started by `distserve.launcher.Cluster` with supervision on, so a
test may `faults_cluster.kill(name)` any child and the launcher restarts it on
the same address. Module scope: each module's kills stay within that module.

After every test that uses the fixture the system must be back to normal and
clean: all children serving, workers registered, and no KV handles in Redis, no
held KV on prefill workers, no used blocks on decode workers (see
tests/cluster_helpers.py). Helpers for tests: `wait_recovered`, `assert_clean`,
`leftover_state`, `wait_for_workers`, `worker_stats` from tests.cluster_helpers.
"""

from __future__ import annotations

import pytest

from distserve.launcher import ClusterSpec
from tests.cluster_helpers import DECODE_TEST_ARGS, PREFILL_TEST_ARGS, assert_clean, running_cluster, wait_recovered

NUM_PREFILL = 2
NUM_DECODE = 2
# KV a prefill worker holds for a request that died with Redis (or the broker) is freed after this.
KV_LEASE_S = 8.0
# A pull from a stalled prefill worker fails after this; the router then prefills again elsewhere.
TRANSFER_TIMEOUT_S = 4.0


def faults_spec(model: str, log_dir: str, **overrides) -> ClusterSpec:
    """The faults suite's system: all ports free, float32, short worker leases, supervised, gateway on;
    its state file (for `distserve status`) is log_dir/up.json."""
    fields = dict(
        model=model, num_prefill=NUM_PREFILL, num_decode=NUM_DECODE, gateway_port=0,
        router_port=0, broker_port=0, prefill_base_port=0, decode_base_port=0, redis_port=0, metrics_base_port=0,
        env={"DISTSERVE_DTYPE": "float32"}, log_dir=log_dir,
        prefill_args=[*PREFILL_TEST_ARGS, "--kv-lease-s", str(KV_LEASE_S)], decode_args=[*DECODE_TEST_ARGS, "--transfer-timeout-s", str(TRANSFER_TIMEOUT_S)],
        supervise=True, state_file=f"{log_dir}/up.json",
    )
    return ClusterSpec(**{**fields, **overrides})


@pytest.fixture(scope="module")
def faults_cluster(tiny_model_path, tmp_path_factory):
    with running_cluster(faults_spec(tiny_model_path, str(tmp_path_factory.mktemp("fault-logs"))), NUM_PREFILL, NUM_DECODE) as cluster:
        yield cluster


@pytest.fixture(autouse=True)
def recovered_and_clean_after(request):
    """After a test using faults_cluster: every child back up and nothing leaked."""
    yield
    if "faults_cluster" not in request.fixturenames:
        return
    cluster = request.getfixturevalue("faults_cluster")
    wait_recovered(cluster, NUM_PREFILL, NUM_DECODE)
    assert_clean(cluster, timeout_s=KV_LEASE_S + 5)
