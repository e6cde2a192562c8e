"""The system across hosts (tests/multihost/conftest.py): output, the gateway, a lost host, a blocked pull.

Every request here goes to the router at host a's address over mutual TLS, or to the gateway there
with its API key; prefill runs on host b and decode on c and d, and KV moves between hosts over TCP.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import grpc
import openai
import pytest
import redis
import torch

from distserve.engine.model_loader import load_model
from distserve.grpc_server import blocking_channel
from distserve.v1 import router_pb2, router_pb2_grpc
from tests.builders import compare_with_tolerance, reference_generate, token_request
from distserve.v1 import lifecycle_pb2, lifecycle_pb2_grpc
from tests.multihost.conftest import API_KEY, PORTS, ROOT, wait_registered

MAX_TOKENS = 16
LONG = 600  # tokens: still decoding when a host is lost


@pytest.fixture(scope="module")
def reference_model(tiny_model_path):
    return load_model(tiny_model_path, "float32", "cpu")


def prompts(count: int, vocab: int, seed: int = 3) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (int(n),), generator=generator).tolist()
            for n in torch.randint(4, 200, (count,), generator=generator)]


class Stream:
    """One Generate call read on a thread: its tokens, who served it, and how it ended."""

    def __init__(self, fleet, request: router_pb2.GenerateRequest):
        self.token_ids: list[int] = []
        self.decode_workers: list[str] = []
        self.error: grpc.RpcError | None = None
        self.decoding = threading.Event()
        channel = blocking_channel(fleet.router_address, fleet.tls)
        self._call = router_pb2_grpc.RouterServiceStub(channel).Generate(
            request, metadata=[("authorization", f"Bearer {API_KEY}")], timeout=180)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for message in self._call:
                if message.decode_worker:
                    self.decode_workers.append(message.decode_worker)
                elif self.token_ids:
                    self.decoding.set()
                self.token_ids.extend(message.token_ids)
        except grpc.RpcError as exc:
            self.error = exc
        finally:
            self.decoding.set()

    def result(self, timeout_s: float = 180) -> list[int]:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), "the stream did not end"
        assert self.error is None, f"the stream failed: {self.error.code()} {self.error.details()}"
        return self.token_ids


def run(fleet, requests: list[router_pb2.GenerateRequest]) -> list[Stream]:
    return [Stream(fleet, request) for request in requests]


def test_greedy_output_across_hosts_matches_transformers(fleet, reference_model):
    batch = prompts(8, reference_model.config.vocab_size)
    streams = run(fleet, [token_request(p, max_tokens=MAX_TOKENS) for p in batch])
    answers = [s.result() for s in streams]
    mismatches = [(len(p), got) for p, got in zip(batch, answers)
                  if not compare_with_tolerance(got, reference_generate(reference_model, p, MAX_TOKENS))[0]]
    assert not mismatches
    hosts = {w.split("-")[1] for s in streams for w in s.decode_workers}
    assert hosts == {fleet.host("c").address, fleet.host("d").address}  # both decode hosts served


def test_the_gateway_across_hosts_streams_with_its_key_and_refuses_without(fleet):
    sdk = openai.OpenAI(base_url=fleet.gateway_url + "/v1", api_key=API_KEY, max_retries=0)
    chunks = list(sdk.chat.completions.create(model="distserve-tiny", max_tokens=8, temperature=0, stream=True,
                                              messages=[{"role": "user", "content": "hello"}]))
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=fleet.gateway_url + "/v1", api_key="wrong", max_retries=0).models.list()


def decoding_streams(fleet, batch: list[list[int]]):
    """Each prompt's greedy LONG-token answer from an undisturbed run, then the same prompts streaming
    again, all of them past their first token, and the decode host the first of them is on."""
    requests = [token_request(p, max_tokens=LONG, ignore_eos=True) for p in batch]
    unfailed = [s.result() for s in run(fleet, requests)]
    streams = run(fleet, requests)
    for stream in streams:
        assert stream.decoding.wait(60), "a stream never reached decode"
    host = next(h for h in (fleet.host("c"), fleet.host("d")) if h.address in streams[0].decode_workers[0])
    return unfailed, streams, host


def test_a_lost_decode_host_moves_its_streams_to_the_other_with_identical_output(fleet, reference_model):
    unfailed, streams, victim = decoding_streams(fleet, prompts(4, reference_model.config.vocab_size, 5))
    fleet.testbed.cut(victim)  # no reset, no FIN: the router finds out from keepalive
    started = time.monotonic()
    try:
        assert [s.result() for s in streams] == unfailed
        moved = [s for s in streams if len(s.decode_workers) > 1]
        assert moved and all(victim.address not in s.decode_workers[-1] for s in moved)
        print(f"{len(moved)} streams moved off host {victim.name} within {time.monotonic() - started:.1f} s")
    finally:
        fleet.testbed.restore(victim)
    wait_registered(fleet, {"prefill": 1, "decode": 2})  # its worker is back once the link is


def test_a_decode_host_drained_mid_stream_exits_0_and_its_streams_end_as_unfailed(fleet, reference_model):
    """A Drain call over mutual TLS (the operator's certificate) with a one-second grace: the streams on
    that host finish there or move to the other host, with identical output; the worker exits 0."""
    unfailed, streams, host = decoding_streams(fleet, prompts(4, reference_model.config.vocab_size, 7))
    with blocking_channel(f"{host.address}:{PORTS['decode']}", fleet.tls) as channel:
        reply = lifecycle_pb2_grpc.LifecycleServiceStub(channel).Drain(
            lifecycle_pb2.DrainRequest(reason="multihost test", grace_s=1), timeout=10)
    assert reply.grace_s == 1 and not reply.already_draining
    try:
        assert [s.result() for s in streams] == unfailed
        assert fleet.services[f"decode-{host.name}"].popen.wait(timeout=60) == 0
    finally:
        if fleet.services[f"decode-{host.name}"].popen.poll() is not None:
            fleet.restart(f"decode-{host.name}")
    wait_registered(fleet, {"prefill": 1, "decode": 2})


def test_a_blocked_kv_pull_is_moved_to_the_other_decode_host(fleet, reference_model):
    """Host c cannot hear host b: c's pulls of KV from b stall, time out (TRANSFER_TIMEOUT_S), and the
    router prefills again and decodes on d. Output stays greedy-exact; c serves again once unblocked."""
    batch = prompts(6, reference_model.config.vocab_size, 9)
    requests = [token_request(p, max_tokens=MAX_TOKENS) for p in batch]
    wait_serving(fleet, fleet.host("c"), requests[:4])  # not still skipped after an earlier test's failure
    fleet.testbed.block(fleet.host("c"), fleet.host("b"))
    try:
        streams = run(fleet, requests)
        answers = [s.result() for s in streams]
    finally:
        fleet.testbed.unblock(fleet.host("c"))
    for prompt, got in zip(batch, answers):
        assert compare_with_tolerance(got, reference_generate(reference_model, prompt, MAX_TOKENS))[0]
    assert all(fleet.host("d").address in s.decode_workers[-1] for s in streams)
    assert any(fleet.host("c").address in s.decode_workers[0] for s in streams)  # some were sent to c first
    wait_serving(fleet, fleet.host("c"), requests[:4])


def wait_serving(fleet, host, requests: list[router_pb2.GenerateRequest], timeout_s: float = 60) -> None:
    """Until one of `requests`, sent together, decodes on `host`: the router skips a worker that failed
    for a while (suspect), then sends it requests again."""
    deadline = time.monotonic() + timeout_s
    while True:
        served = run(fleet, requests)
        if any(host.address in s.decode_workers[-1] for s in served if s.result()):
            return
        assert time.monotonic() < deadline, f"host {host.name} never served"
        time.sleep(1)


def stranger_pull(fleet, host: str, address: str) -> str:
    """How a KV pull from `host` (a stranger with a well-formed secret) to `address` ends (ucx_pull.py)."""
    env = {**os.environ, "UCX_TLS": "tcp", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(fleet.testbed.command(fleet.host(host), [
        sys.executable, "-m", "tests.multihost.ucx_pull", address]), env=env, cwd=ROOT, capture_output=True,
        text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.strip().splitlines()[-1]


def test_the_ucx_listener_serves_only_registered_peers_on_its_advertised_address(fleet):
    """The listener binds host b's advertised address only, so a pull through b's loopback finds nothing
    listening; on that address, the prefill worker checks each new connection's peer: one from host a (no
    decode or colocated worker there) is dropped before it can ask for anything; one from decode host c
    reaches the request check (and learns only that the handle is not held)."""
    record = json.loads(redis.Redis.from_url(fleet.redis_url).get(
        next(iter(redis.Redis.from_url(fleet.redis_url).keys("distserve:worker:prefill:*")))))
    ucx_port = record["ucx_address"].rpartition(":")[2]
    b = fleet.host("b").address
    assert stranger_pull(fleet, "c", f"{b}:{ucx_port}").startswith("answered: ")
    assert stranger_pull(fleet, "a", f"{b}:{ucx_port}").startswith("refused")
    assert stranger_pull(fleet, "b", f"127.0.0.1:{ucx_port}").startswith("refused")
    log = fleet.log("prefill")
    assert f"{fleet.host('a').address} is not the address of a registered decode or colocated worker" in log
    assert "arrived on 127.0.0.1" not in log  # refused by the kernel: the listener is not bound there
