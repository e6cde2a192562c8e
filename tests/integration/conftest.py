"""One fixture starts the real system: Redis, kvbroker, router, 2 prefill + 2 decode processes.

After every test the system must be clean: no KV handle keys in Redis, no
held KV on prefill workers, no used KV blocks on decode workers.
"""

from __future__ import annotations

import pytest

from distserve.launcher import Cluster, ClusterSpec
from tests.cluster_helpers import (  # noqa: F401 (re-exported: tests import them from here)
    DECODE_TEST_ARGS, PREFILL_TEST_ARGS, WORKER_LEASE_S, assert_clean, leftover_state, wait_for_workers, worker_stats)
from tests.otlp_receiver import OtlpReceiver


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
        prefill_args=PREFILL_TEST_ARGS, decode_args=DECODE_TEST_ARGS,
    )
    cluster = Cluster(spec).start()
    wait_for_workers(cluster, 2, 2)
    yield cluster
    cluster.stop()


@pytest.fixture(autouse=True)
def system_is_clean_after(cluster):
    yield
    assert_clean(cluster)
