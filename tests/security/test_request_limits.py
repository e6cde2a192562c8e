"""What one request can cost the system: grammars are compiled under a deadline in a process that is killed
at it, requests are size-capped, and nothing of `up` listens on every interface but the UCX listener.

Against the real system of `signed_cluster` (its router's grammar deadline is GRAMMAR_COMPILE_TIMEOUT_S)."""

from __future__ import annotations

import concurrent.futures
import json
import time

import grpc
import redis

from distserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from tests.builders import generate, sampling, token_request
from tests.listening_sockets import listening_ips, listening_ips_of, wildcard_ports
from tests.security.conftest import GRAMMAR_COMPILE_TIMEOUT_S

LOOPBACK = {"127.0.0.1", "::1"}
# Ambiguous and recursive: xgrammar spends minutes on it, though it is 8 KiB, under the 64 KiB size cap.
SLOW_GRAMMAR = "root ::= r0\n" + "\n".join(
    f'r{i} ::= r{i + 1} r{i + 1} | "a{i}" r{i + 1} | [^q]*' for i in range(200)) + '\nr200 ::= "b"'


def constrained(structured: common_pb2.StructuredOutput) -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(text="hello", sampling=sampling(max_tokens=4, structured_output=structured))


def refusal(address: str, request: router_pb2.GenerateRequest) -> tuple[grpc.RpcError, float]:
    """The error a request fails with, and how long that took."""
    started = time.monotonic()
    try:
        generate(address, request, timeout=60)
    except grpc.RpcError as exc:
        return exc, time.monotonic() - started
    raise AssertionError("the request was not refused")


def test_a_grammar_past_the_compile_deadline_is_refused_within_a_second_and_others_go_on(signed_cluster):
    router = signed_cluster.router_address
    warm = generate(router, constrained(common_pb2.StructuredOutput(regex="[a-z]+")))  # the compiler is up
    assert warm.token_ids
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        ordinary = pool.submit(generate, router, token_request([5, 6, 7, 8], max_tokens=24, ignore_eos=True))
        error, took_s = refusal(router, constrained(common_pb2.StructuredOutput(grammar=SLOW_GRAMMAR)))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"did not compile within {GRAMMAR_COMPILE_TIMEOUT_S:g}s" in error.details()
        assert took_s < 1.0
        assert len(ordinary.result(timeout=120).token_ids) == 24
    error, took_s = refusal(router, constrained(common_pb2.StructuredOutput(grammar=SLOW_GRAMMAR)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and took_s < 0.5  # its verdict is cached
    assert generate(router, constrained(common_pb2.StructuredOutput(regex="[0-9]+"))).token_ids  # a new compiler


def test_a_one_mib_regex_is_refused_at_once_naming_the_field(signed_cluster):
    error, took_s = refusal(signed_cluster.router_address,
                            constrained(common_pb2.StructuredOutput(regex="a" * (1 << 20))))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().startswith("structured_output") and "65536" in error.details()
    assert took_s < 1.0


def test_a_request_over_the_routers_message_cap_is_refused(signed_cluster):
    with grpc.insecure_channel(signed_cluster.router_address,
                               options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)
        try:
            list(stub.Generate(router_pb2.GenerateRequest(text="x" * (5 << 20), sampling=sampling()), timeout=60))
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        else:
            raise AssertionError("a 5 MiB request was accepted")
    assert generate(signed_cluster.router_address, token_request([5, 6], max_tokens=2)).token_ids


def test_nothing_listens_on_every_interface(signed_cluster):
    """Every gRPC, metrics, HTTP and UCX port binds the address its process advertises, loopback here:
    the prefill workers' UCX listeners too (distserve.transfer.bound_listener), and UCX's TCP transport
    in prefill and decode workers (distserve.transfer.ucx_devices)."""
    client = redis.Redis.from_url(signed_cluster.redis_url)
    ucx_ports = {int(json.loads(client.get(key))["ucx_address"].rpartition(":")[2])
                 for key in client.keys("distserve:worker:prefill:*")}
    assert ucx_ports
    for port in ucx_ports:
        assert listening_ips(port) == {"127.0.0.1"}, f"the UCX listener at {port} binds {listening_ips(port)}"
    for name, process in signed_cluster.processes.items():
        ports = wildcard_ports(process.popen.pid)
        assert not ports, f"{name} listens on every interface at {sorted(ports)}"
        outside = listening_ips_of(process.popen.pid) - LOOPBACK
        assert not outside, f"{name} listens on {sorted(outside)}"