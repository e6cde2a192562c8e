"""Draining a decode worker that streams eight or more requests (SIGTERM, or a Drain call).

Within its grace every stream finishes where it is; past a shorter grace (a Drain call's grace_s) the
rest move to the other decode worker. Either way every output equals an undisturbed run's and the
drained worker exits 0; the fixture then checks that the supervisor started it again and that no KV
handle, held KV or block leaked.
"""

from __future__ import annotations

import collections

import pytest

from distserve.v1 import common_pb2
from tests.cluster_helpers import drain, worker_stats
from tests.faults.test_migration import _process_name, _run_all

STREAMS = 16  # over the fixture's two decode workers: one of them holds at least eight
MAX_TOKENS = 1800  # the context is 2048: long enough to outlive a one-second grace on a fast machine

REQUESTS = [(f"Request {i}: the quick brown fox jumps over",
             common_pb2.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.8 * (i % 2), seed=i))
            for i in range(STREAMS)]  # greedy and seeded sampling, alternately


@pytest.fixture(scope="module")
def undisturbed(faults_cluster) -> list[list[int]]:
    return [stream.result() for stream in _run_all(faults_cluster, REQUESTS)]


def _start_on_the_busiest(cluster):
    """Starts every request and waits until all decode; returns them, the launcher name of the decode
    worker streaming most of them, and those it streams (at least eight)."""
    streams = _run_all(cluster, REQUESTS)
    for stream in streams:
        assert stream.decoding.wait(60), "a stream never reached decode"
    worker, _ = collections.Counter(s.decode_worker for s in streams).most_common(1)[0]
    on_it = [s for s in streams if s.decode_worker == worker]
    assert len(on_it) >= 8
    name = _process_name(cluster, worker)
    assert worker_stats(cluster, name).num_running >= 8
    return streams, name, on_it


def test_sigterm_with_eight_streams_in_flight_lets_each_finish_there_and_exits_0(faults_cluster, undisturbed):
    streams, name, on_it = _start_on_the_busiest(faults_cluster)
    process = faults_cluster.processes[name].popen  # the supervisor swaps in a new one after the exit
    process.terminate()
    assert [s.result() for s in streams] == undisturbed
    assert all(s.decode_workers == [s.decode_worker] for s in on_it)  # none had to move
    assert process.wait(timeout=60) == 0


def test_a_drain_grace_shorter_than_the_streams_moves_the_rest_with_identical_output(faults_cluster,
                                                                                     undisturbed):
    streams, name, on_it = _start_on_the_busiest(faults_cluster)
    process = faults_cluster.processes[name].popen
    assert drain(faults_cluster.processes[name].address, grace_s=1).grace_s == 1
    assert [s.result() for s in streams] == undisturbed
    assert any(len(s.decode_workers) == 2 for s in on_it)  # moved to the other decode worker
    assert all(s.decode_workers[0] == s.decode_worker for s in on_it)
    assert process.wait(timeout=30) == 0
