"""Chaos tests: kill -9 a child with requests in flight; the launcher restarts it and the system recovers."""

from __future__ import annotations

from tests.builders import generate, token_request


def test_fixture_serves(faults_cluster):
    answer = generate(faults_cluster.router_address, token_request([30, 31, 32], max_tokens=8), timeout=60)
    assert len(answer.token_ids) == 8
