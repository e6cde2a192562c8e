"""A Redis that stops answering (SIGSTOP, as a hung or partitioned Redis would): every request ends
within a bound, served or with a clear error, none hangs to its deadline; once Redis answers again
(SIGCONT) the system serves as before, and nothing leaks (the conftest's check)."""

from __future__ import annotations

import os
import signal
import time

import grpc

from tests.builders import generate, token_request

PROMPT = [11, 12, 13, 14, 15, 16]
# A request must end this soon while Redis is stalled: the services' Redis sockets time out after 5 s,
# their kvbroker calls after 5 s.
BOUND_S = 30.0


def test_a_stalled_redis_turns_into_clear_errors_and_the_system_serves_again(signed_cluster):
    reference = generate(signed_cluster.router_address, token_request(PROMPT, max_tokens=8), timeout=60).token_ids
    pid = signed_cluster.processes["redis"].popen.pid
    os.kill(pid, signal.SIGSTOP)
    outcomes = []
    try:
        for _ in range(3):
            started = time.monotonic()
            try:
                answer = generate(signed_cluster.router_address, token_request(PROMPT, max_tokens=8),
                                  timeout=2 * BOUND_S)
                outcomes.append("served" if answer.token_ids == reference else f"wrong {answer.token_ids}")
            except grpc.RpcError as exc:
                assert exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED, "a request hung while Redis was stalled"
                assert exc.details(), exc
                outcomes.append(exc.code().name)
            assert time.monotonic() - started < BOUND_S, outcomes
    finally:
        os.kill(pid, signal.SIGCONT)
    assert not any(o.startswith("wrong") for o in outcomes), outcomes
    deadline = time.monotonic() + 60
    while True:  # served again, as before: leases and connections come back on their own
        try:
            if generate(signed_cluster.router_address, token_request(PROMPT, max_tokens=8), timeout=30).token_ids \
                    == reference:
                break
        except grpc.RpcError:
            pass
        assert time.monotonic() < deadline, f"not serving a minute after Redis resumed (stalled: {outcomes})"
        time.sleep(1)
    print(f"while Redis was stalled: {outcomes}")
