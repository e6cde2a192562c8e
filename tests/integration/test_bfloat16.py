"""bfloat16 end to end: KV travels as bf16 (half the bytes of fp32) and greedy output matches transformers in bf16."""

from __future__ import annotations

import pytest

from distserve.engine.model_loader import load_model
from distserve.model_spec import load_model_spec
from distserve.launcher import Cluster, ClusterSpec
from tests.builders import compare_with_tolerance, generate, reference_generate, token_request
from tests.integration.conftest import wait_for_workers, worker_stats

PROMPT_LEN = 200


@pytest.fixture(scope="module")
def bf16_cluster(tiny_model_path, tmp_path_factory):
    spec = ClusterSpec(model=tiny_model_path, router_port=0, broker_port=0, prefill_base_port=0,
                       decode_base_port=0, redis_port=0, metrics_base_port=0, gateway_port=None,
                       log_dir=str(tmp_path_factory.mktemp("bf16-logs")), env={"DISTSERVE_DTYPE": "bfloat16"})
    cluster = Cluster(spec).start()
    wait_for_workers(cluster, 1, 1)
    yield cluster
    cluster.stop()


def test_bfloat16_kv_transfer_and_greedy_output(bf16_cluster, tiny_model_path):
    prompt = [(i * 37) % 4000 + 3 for i in range(PROMPT_LEN)]
    answer = generate(bf16_cluster.router_address, token_request(prompt, max_tokens=12))
    spec = load_model_spec(tiny_model_path)
    handle_bytes = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * PROMPT_LEN * 2  # bf16
    assert worker_stats(bf16_cluster, "prefill-0").kv_bytes_sent == handle_bytes
    assert worker_stats(bf16_cluster, "decode-0").kv_bytes_received == handle_bytes
    reference = reference_generate(load_model(tiny_model_path, "bfloat16", "cpu"), prompt, 12)
    ok, _ = compare_with_tolerance(answer.token_ids, reference, tie_eps=1e-2)  # bf16 rounding is coarse
    assert ok, (answer.token_ids, reference.token_ids)
    assert worker_stats(bf16_cluster, "decode-0").num_used_blocks == 0
