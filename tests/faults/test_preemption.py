"""Preemption: a decode worker whose KV cache fills up mid-stream moves its youngest sequence on.

One decode worker with a 1 MiB cache (128 blocks of 16 tokens for the tiny model) runs two
sequences that each grow to ~76 blocks. Blocks are reserved a little ahead and grown as decoding
goes, so both start; when the cache is full the younger is preempted, the router re-prefills its
prompt plus its tokens so far and decoding continues once blocks are free. Both outputs equal
their unfailed runs, token for token.
"""

from __future__ import annotations

import pytest

from tests.cluster_helpers import DECODE_TEST_ARGS, assert_clean, running_cluster
from tests.faults.conftest import faults_spec
from tests.faults.test_migration import LONG, REQUESTS, _router_retries, _run_all

SMALL_CACHE_ARGS = DECODE_TEST_ARGS + ["--kv-cache-mb", "1", "--reserve-ahead-tokens", "64"]


@pytest.fixture(scope="module")
def small_cache_cluster(tiny_model_path, tmp_path_factory):
    spec = faults_spec(tiny_model_path, str(tmp_path_factory.mktemp("preemption-logs")), num_prefill=1,
                       num_decode=1, gateway_port=None, decode_args=SMALL_CACHE_ARGS)
    with running_cluster(spec, 1, 1) as cluster:
        yield cluster


def test_a_full_decode_cache_preempts_the_younger_sequence_which_finishes_with_identical_output(
        small_cache_cluster):
    greedy, seeded = REQUESTS[0], REQUESTS[1]
    alone = [_run_all(small_cache_cluster, [request])[0].result() for request in (greedy, seeded)]
    retries_before = _router_retries(small_cache_cluster, "decode")

    together = [stream.result() for stream in _run_all(small_cache_cluster, [greedy, seeded])]

    assert together == alone
    assert all(len(tokens) == LONG for tokens in together)
    assert _router_retries(small_cache_cluster, "decode") >= retries_before + 1  # the preempted one moved
    assert_clean(small_cache_cluster, timeout_s=10)
