"""`signed_cluster`: a real system whose registry and KV handle records are signed, one per test module.

Started as `distserve up` starts it (distserve.launcher.Cluster: a fresh registry key in its log folder,
handed to every child), on the faults suite's settings (tests/faults/conftest.py `faults_spec`: free
ports, float32, short leases) cut down to the cheapest system that still routes and moves KV: one
prefill and one decode worker, no gateway, unsupervised, and a router that refuses a grammar not compiled
within GRAMMAR_COMPILE_TIMEOUT_S. After every test: nothing leaked (no KV handles
in Redis, no held KV, no used blocks), and whatever a test planted in Redis is gone (`planted`).
"""

from __future__ import annotations

import pytest
import redis

from tests.cluster_helpers import assert_clean, running_cluster
from tests.faults.conftest import KV_LEASE_S, faults_spec

GRAMMAR_COMPILE_TIMEOUT_S = 0.5  # the router's deadline on compiling a structured-output spec


@pytest.fixture(scope="module")
def signed_cluster(tiny_model_path, tmp_path_factory):
    spec = faults_spec(tiny_model_path, str(tmp_path_factory.mktemp("security-logs")), num_prefill=1, num_decode=1,
                       gateway_port=None, supervise=False, state_file="",
                       env={"DISTSERVE_DTYPE": "float32",
                            "DISTSERVE_ROUTER_GRAMMAR_COMPILE_TIMEOUT_S": str(GRAMMAR_COMPILE_TIMEOUT_S)})
    with running_cluster(spec, 1, 1) as cluster:
        yield cluster


@pytest.fixture(autouse=True)
def clean_after(request):
    """After a test using signed_cluster: no KV handle left in Redis, no KV held, no blocks used."""
    yield
    if "signed_cluster" in request.fixturenames:
        assert_clean(request.getfixturevalue("signed_cluster"), timeout_s=KV_LEASE_S + 5)


@pytest.fixture
def planted(signed_cluster):
    """Worker records a test writes into Redis behind the services' backs: `planted[key] = index` (the
    sorted set indexing it); both are deleted after the test."""
    keys: dict[str, str] = {}
    yield keys
    client = redis.Redis.from_url(signed_cluster.redis_url)
    for key, index in keys.items():
        client.delete(key)
        client.zrem(index, key.rpartition(":")[2])
