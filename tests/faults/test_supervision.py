"""Chaos tests: kill -9 one child with requests in flight; supervision restarts it and the system recovers.

Each test shows three things:
- outcome: every request in flight at the kill either finishes (all its tokens, finish reason LENGTH) or
  ends with a clear gRPC / HTTP error, within OUTCOME_BOUND_S: nothing hangs. Where the killed process
  is not on a streaming request's path any more (kvbroker, Redis, a prefill worker once the KV has
  moved), the requests must finish;
- recovery: the launcher restarts the process (new pid, restarts + 1) on its old address, and a new
  request's greedy output is identical to the one answered before any kill;
- no leak: after each test no KV handles in Redis, no held KV, no used blocks (conftest's autouse check).
Decode workers are killed in test_migration.py (request migration), not here.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request

import grpc
import pytest
import redis

from distserve.v1 import common_pb2, router_pb2_grpc
from tests.builders import generate, token_request
from tests.cluster_helpers import wait_recovered
from tests.faults.conftest import NUM_DECODE, NUM_PREFILL

PROMPT = [30, 31, 32, 33, 34, 35]
LONG_TOKENS = 300  # long enough that requests are still streaming when the kill lands
OUTCOME_BOUND_S = 30.0
LENGTH = common_pb2.FINISH_REASON_LENGTH


@dataclasses.dataclass
class Outcome:
    num_tokens: int = 0
    finish_reason: int | None = None
    error: str = ""  # status code name (gRPC) or exception (HTTP); empty if it finished
    details: str = ""

    @property
    def finished(self) -> bool:
        return not self.error and self.finish_reason == LENGTH and self.num_tokens == LONG_TOKENS


class InFlight:
    """A streaming request in a thread: `started` is set once decoding streams (the first token comes from
    the prefill worker, the later ones from a decode worker holding the KV), `outcome` when it ends."""

    def __init__(self, run):
        self.started = threading.Event()
        self.outcome = Outcome()
        self._thread = threading.Thread(target=self._guarded, args=(run,), daemon=True)
        self._thread.start()

    def _guarded(self, run) -> None:
        try:
            run(self)
        finally:
            self.started.set()  # a request that failed before its first token is in flight no more

    def wait(self, timeout_s: float) -> Outcome:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), f"request still hanging {timeout_s}s after the kill: {self.outcome}"
        return self.outcome


def grpc_stream(address: str, prompt: list[int]):
    def run(flight: InFlight) -> None:
        with grpc.insecure_channel(address) as channel:
            stream = router_pb2_grpc.RouterServiceStub(channel).Generate(
                token_request(prompt, max_tokens=LONG_TOKENS, ignore_eos=True), timeout=120)
            try:
                for message in stream:
                    flight.outcome.num_tokens += len(message.token_ids)
                    if flight.outcome.num_tokens >= 2:
                        flight.started.set()
                    if message.finish_reason:
                        flight.outcome.finish_reason = message.finish_reason
            except grpc.RpcError as exc:
                flight.outcome.error, flight.outcome.details = exc.code().name, exc.details() or ""
    return InFlight(run)


def http_stream(gateway_url: str, prompt: str):
    def run(flight: InFlight) -> None:
        url = urllib.parse.urlsplit(gateway_url)
        connection = http.client.HTTPConnection(url.hostname, url.port, timeout=120)
        body = {"prompt": prompt, "max_tokens": LONG_TOKENS, "ignore_eos": True, "temperature": 0, "stream": True}
        events = 0
        try:
            connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
            reply = connection.getresponse()
            for line in reply:
                if not line.startswith(b"data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:  # errors after the stream began come in-band
                    flight.outcome.error, flight.outcome.details = "in-band error", json.dumps(event["error"])
                    break
                events += 1
                if events >= 2:
                    flight.started.set()
                if event["choices"][0].get("finish_reason") == "length":
                    flight.outcome.finish_reason, flight.outcome.num_tokens = LENGTH, LONG_TOKENS
            if flight.outcome.finish_reason is None and not flight.outcome.error:
                flight.outcome.error = flight.outcome.details = "stream ended without a finish reason"
        except (OSError, http.client.HTTPException) as exc:
            flight.outcome.error, flight.outcome.details = type(exc).__name__, str(exc)
        finally:
            connection.close()
    return InFlight(run)


def start_in_flight(cluster, count: int = 3, via: str = "grpc") -> list[InFlight]:
    """`count` long requests, each streaming (first token seen) before this returns."""
    flights = [grpc_stream(cluster.router_address, [40 + i, *PROMPT]) if via == "grpc"
               else http_stream(cluster.gateway_url, f"Once upon a time {i}") for i in range(count)]
    for flight in flights:
        assert flight.started.wait(60), "request never started streaming"
    return flights


def outcomes_after(flights: list[InFlight]) -> list[Outcome]:
    """Each in-flight request's outcome; fails if one is still running OUTCOME_BOUND_S after the kill."""
    deadline = time.monotonic() + OUTCOME_BOUND_S
    outcomes = [f.wait(max(0.1, deadline - time.monotonic())) for f in flights]
    for outcome in outcomes:
        assert outcome.finished or (outcome.error and outcome.details), f"neither finished nor a clear error: {outcome}"
    return outcomes


def request_during_outage(cluster) -> None:
    """A request sent while the killed process is down succeeds or fails clearly, within the bound."""
    started = time.monotonic()
    try:
        generate(cluster.router_address, token_request(PROMPT, max_tokens=8), timeout=OUTCOME_BOUND_S)
    except grpc.RpcError as exc:
        assert exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED, "a request during the outage hung"
        assert exc.details(), exc
    assert time.monotonic() - started < OUTCOME_BOUND_S


def kill_and_recover(cluster, name: str, reference: list[int], flights: list[InFlight]) -> list[Outcome]:
    """kill -9 `name` while `flights` stream; returns their outcomes (each within OUTCOME_BOUND_S of the
    kill). Then the launcher must restart `name` and a new request must answer as before the kill."""
    process = cluster.processes[name]
    old_pid, old_restarts = process.popen.pid, process.restarts
    cluster.kill(name)
    outcomes = outcomes_after(flights)
    request_during_outage(cluster)
    wait_recovered(cluster, NUM_PREFILL, NUM_DECODE, timeout_s=90)
    assert process.popen.pid != old_pid and process.restarts == old_restarts + 1 and process.state == "running"
    assert answer(cluster) == reference
    return outcomes


def answer(cluster) -> list[int]:
    return generate(cluster.router_address, token_request(PROMPT, max_tokens=24), timeout=60).token_ids


@pytest.fixture(scope="module")
def reference(faults_cluster) -> list[int]:
    """The greedy answer before any kill."""
    tokens = answer(faults_cluster)
    assert len(tokens) == 24
    return tokens


def test_kvbroker_killed(faults_cluster, reference):
    outcomes = kill_and_recover(faults_cluster, "kvbroker", reference, start_in_flight(faults_cluster))
    # Streaming requests hold their KV on a decode worker already: the broker is off their path.
    assert all(o.finished for o in outcomes), outcomes


def test_redis_killed(faults_cluster, reference):
    # Redis comes back empty: workers re-register with their next heartbeat, handles are gone.
    outcomes = kill_and_recover(faults_cluster, "redis", reference, start_in_flight(faults_cluster))
    assert all(o.finished for o in outcomes), outcomes


def test_requests_right_after_redis_lost_its_data_are_served(faults_cluster, reference):
    """Redis flushed while every worker is paused past the router's next registry read (as after a Redis
    restart, before the workers' next heartbeats): the router keeps the workers it knew, so a request
    sent the moment they resume is served, not refused with "no prefill worker is registered"."""
    workers = [p.popen.pid for name, p in faults_cluster.processes.items() if name.startswith(("prefill", "decode"))]
    for pid in workers:
        os.kill(pid, signal.SIGSTOP)
    try:
        redis.Redis.from_url(faults_cluster.redis_url).flushall()
        time.sleep(1.5)  # the router reads the registry every 0.5 s: it has seen it empty
    finally:
        for pid in workers:
            os.kill(pid, signal.SIGCONT)
    assert answer(faults_cluster) == reference


def test_prefill_worker_killed(faults_cluster, reference):
    outcomes = kill_and_recover(faults_cluster, "prefill-0", reference, start_in_flight(faults_cluster))
    # Their KV moved to decode workers before the first token: the prefill worker is off their path.
    assert all(o.finished for o in outcomes), outcomes


def test_router_killed(faults_cluster, reference):
    outcomes = kill_and_recover(faults_cluster, "router", reference, start_in_flight(faults_cluster))
    for outcome in outcomes:  # their connection was to the router: cut, and said so
        assert outcome.error == "UNAVAILABLE", outcome


def test_gateway_killed(faults_cluster, reference):
    flights = start_in_flight(faults_cluster, via="http")
    for outcome in kill_and_recover(faults_cluster, "gateway", reference, flights):
        assert outcome.error, outcome  # the HTTP connection was cut; the router then cancels their work
    with urllib.request.urlopen(faults_cluster.gateway_url + "/v1/models", timeout=10) as reply:
        assert reply.status == 200  # the gateway answers again


@pytest.mark.parametrize("name", ["kvbroker", "decode-1"])
def test_a_hung_child_is_killed_and_restarted(faults_cluster, reference, name):
    """SIGSTOP: alive but answering nothing. Past the hang window (3 s here, 30 s by default) the
    supervisor kills it, restarts it, and the system answers as before."""
    import os
    import signal

    supervisor = faults_cluster.supervisor
    policy = supervisor.policy
    supervisor.policy = dataclasses.replace(policy, hang_after_s=3.0)
    process = faults_cluster.processes[name]
    old_pid, old_restarts = process.popen.pid, process.restarts
    try:
        os.kill(old_pid, signal.SIGSTOP)
        deadline = time.monotonic() + 30
        while process.restarts == old_restarts and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        supervisor.policy = policy
        if process.popen.pid == old_pid:
            os.kill(old_pid, signal.SIGCONT)
    assert process.restarts == old_restarts + 1 and process.popen.pid != old_pid, "the hung child was not restarted"
    wait_recovered(faults_cluster, NUM_PREFILL, NUM_DECODE, timeout_s=90)
    assert answer(faults_cluster) == reference


def test_status_shows_every_service_with_restarts_health_and_load(faults_cluster, reference):
    # After the kills above (when run with them): their restarts show, and every child is SERVING again.
    reply = subprocess.run([sys.executable, "-m", "distserve.cli", "status", "--state-file",
                            faults_cluster.spec.state_file], capture_output=True, text=True, timeout=60)
    assert reply.returncode == 0, reply.stderr
    rows = {line.split()[0]: line for line in reply.stdout.splitlines()[1:]}
    assert set(rows) == set(faults_cluster.processes), reply.stdout
    for name, process in faults_cluster.processes.items():
        row = rows[name]
        assert row.split()[1] == str(process.popen.pid) and " SERVING" in row, row
        assert row.split()[3] == str(process.restarts), row
    assert "free blocks" in rows["decode-0"] and "held KV bytes" in rows["prefill-0"], reply.stdout
    assert faults_cluster.processes["router"].address in rows["router"]
