"""Request migration for spilled requests: a worker killed (-9) while its colocated half streams a
whole request costs the client nothing.

Two prefill and two decode workers, each also serving whole requests (`distserve up --spill`), with
saturation set to one sequence per decode worker, so the third and fourth of four concurrent requests
spill. When the worker streaming a spilled request dies, the router re-prefills its prompt plus its
completion so far on a live prefill worker and decodes on a live decode worker; every client stream
equals an unfailed run's, token for token, greedy and seeded sampling alike.
"""

from __future__ import annotations

import dataclasses

import grpc
import pytest

from distserve.v1 import colocated_pb2, colocated_pb2_grpc, common_pb2
from tests.cluster_helpers import assert_clean, running_cluster, wait_recovered
from tests.faults.conftest import KV_LEASE_S, faults_spec
from tests.faults.test_migration import REQUESTS, _process_name, _router_retries, _run_all


def _with_max_tokens(sampling: common_pb2.SamplingParams, max_tokens: int) -> common_pb2.SamplingParams:
    copy = common_pb2.SamplingParams()
    copy.CopyFrom(sampling)
    copy.max_tokens = max_tokens
    return copy


NUM_WORKERS = 2  # prefill and decode each; every one registers a spill-only colocated record too
# test_migration's requests, shorter (the kill lands right after every stream's second message)
SPILL_REQUESTS = [(prompt, _with_max_tokens(sampling, 500)) for prompt, sampling in REQUESTS]


@pytest.fixture(scope="module")
def spill_cluster(tiny_model_path, tmp_path_factory):
    spec = faults_spec(tiny_model_path, str(tmp_path_factory.mktemp("spill-fault-logs")), gateway_port=None)
    spec = dataclasses.replace(
        spec, spill=True, prefill_args=[*spec.prefill_args, "--colocated-kv-cache-mb", "64"],
        decode_args=[*spec.decode_args, "--max-batch-tokens", "256"],
        env={**spec.env, "DISTSERVE_ROUTER_SPILL_DECODE_RUNNING": "1"})  # saturated at one sequence
    with running_cluster(spec, NUM_WORKERS, NUM_WORKERS, num_colocated=2 * NUM_WORKERS) as cluster:
        yield cluster


def colocated_used_blocks(cluster) -> dict[str, int]:
    """Used KV blocks of each worker's colocated half."""
    used = {}
    for name, process in cluster.processes.items():
        if name.startswith(("prefill", "decode")):
            with grpc.insecure_channel(process.address) as channel:
                used[name] = colocated_pb2_grpc.ColocatedServiceStub(channel).GetColocatedStats(
                    colocated_pb2.GetColocatedStatsRequest(), timeout=10).num_used_blocks
    return used


@pytest.fixture(autouse=True)
def recovered_and_clean_after(spill_cluster):
    yield
    wait_recovered(spill_cluster, NUM_WORKERS, NUM_WORKERS, num_colocated=2 * NUM_WORKERS)
    assert_clean(spill_cluster, timeout_s=KV_LEASE_S + 5)
    assert not any(colocated_used_blocks(spill_cluster).values()), colocated_used_blocks(spill_cluster)


@pytest.fixture(scope="module")
def unfailed(spill_cluster) -> list[list[int]]:
    """Each request's tokens from a run where nothing failed (some of them spilled)."""
    return [stream.result() for stream in _run_all(spill_cluster, SPILL_REQUESTS)]


def test_a_worker_killed_while_streaming_spilled_requests_moves_them_to_a_pair(spill_cluster, unfailed):
    retries_before = _router_retries(spill_cluster, "colocated")
    streams = _run_all(spill_cluster, SPILL_REQUESTS)
    for stream in streams:
        assert stream.decoding.wait(60), "no stream reached decode"
    spilled = [s for s in streams if s.prefill_worker == s.decode_worker]  # one worker prefilled and decodes
    assert spilled, [(s.prefill_worker, s.decode_worker) for s in streams]
    victim = spilled[0].decode_worker
    spill_cluster.kill(_process_name(spill_cluster, victim))
    moved = [s for s in spilled if s.decode_worker == victim]

    assert [s.result() for s in streams] == unfailed
    assert all(s.messages > 2 for s in moved)  # the victim streamed some, a pair the rest
    assert _router_retries(spill_cluster, "colocated") >= retries_before + len(moved)
