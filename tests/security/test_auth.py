"""Refusing strangers, on a real system: every gRPC service under mutual TLS, the gateway behind an API key.

The system (Redis, kvbroker, router, 1 prefill, 1 decode, gateway as processes) runs with
certificates from a throwaway CA and DISTSERVE_API_KEY set. A request that succeeds here has
crossed every internal hop (gateway -> router -> broker, prefill, decode) over mutual TLS.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest

from distserve.cli import main
from distserve.client import Completion, DistServeError, DistServeSyncClient
from distserve.dev_certs import make_ca, make_dev_certs, make_signed_cert, role_tls
from distserve.grpc_server import PLAINTEXT, TlsConfig, blocking_channel
from distserve.launcher import ClusterSpec
from distserve.v1 import decode_pb2, decode_pb2_grpc
from tests.cluster_helpers import DECODE_TEST_ARGS, PREFILL_TEST_ARGS, running_cluster

API_KEY = "sk-auth-test"


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> TlsConfig:
    return make_dev_certs(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def secure_cluster(tiny_model_path, tmp_path_factory, certs):
    spec = ClusterSpec(model=tiny_model_path, num_prefill=1, num_decode=1, gateway_port=0, router_port=0,
                       broker_port=0, prefill_base_port=0, decode_base_port=0, redis_port=0, metrics_base_port=0,
                       env={"DISTSERVE_DTYPE": "float32", "DISTSERVE_API_KEY": API_KEY}, tls=certs,
                       log_dir=str(tmp_path_factory.mktemp("auth-logs")),
                       prefill_args=PREFILL_TEST_ARGS, decode_args=DECODE_TEST_ARGS)
    with running_cluster(spec, 1, 1) as cluster:
        yield cluster


def generate(address: str, tls: TlsConfig, api_key: str = API_KEY) -> Completion:
    with DistServeSyncClient(address, tls, timeout_s=60, api_key=api_key) as client:
        return client.complete("hello", max_tokens=3, temperature=0)


def stranger_cert(folder, trusted_ca: str) -> TlsConfig:
    """A client certificate from another CA (that still trusts the system's CA for the server's side)."""
    make_ca(folder / "ca.pem", folder / "ca-key.pem", days=1, name="stranger-ca")
    make_signed_cert(folder / "ca.pem", folder / "ca-key.pem", folder / "cert.pem", folder / "key.pem", days=1)
    return TlsConfig(tls_cert=str(folder / "cert.pem"), tls_key=str(folder / "key.pem"), tls_ca=trusted_ca)


def test_the_router_answers_a_client_with_the_right_certificate(secure_cluster, certs):
    answer = generate(secure_cluster.router_address, certs)
    assert len(answer.token_ids) == 3 and answer.finish_reason


def test_the_router_refuses_a_call_without_the_api_key_even_with_the_right_certificate(secure_cluster, certs):
    for key in ("", "sk-wrong"):
        with pytest.raises(DistServeError) as error:
            generate(secure_cluster.router_address, certs, api_key=key)
        assert error.value.code == grpc.StatusCode.UNAUTHENTICATED and "authorization" in error.value.message


def test_distserve_generate_with_the_tls_dir_of_distserve_up(secure_cluster, certs, capsys, monkeypatch):
    monkeypatch.setenv("DISTSERVE_API_KEY", API_KEY)  # the CLI presents the deployment's key from there
    tls_dir = str(Path(certs.tls_ca).parent)
    argv = ["generate", "hello", "--router", secure_cluster.router_address, "--max-tokens", "3"]
    assert main([*argv, "--tls-dir", tls_dir]) == 0
    assert capsys.readouterr().out == generate(secure_cluster.router_address, certs).text + "\n"
    assert main(argv) == 1
    assert capsys.readouterr().err.startswith("error: UNAVAILABLE")


@pytest.mark.parametrize("name", ["router", "kvbroker", "prefill-0", "decode-0"])
def test_every_service_refuses_a_plaintext_client(secure_cluster, name):
    with pytest.raises(DistServeError) as error:
        generate(secure_cluster.processes[name].address, PLAINTEXT)
    assert error.value.code == grpc.StatusCode.UNAVAILABLE


def test_the_router_refuses_a_certificate_from_another_ca(secure_cluster, certs, tmp_path):
    with pytest.raises(DistServeError) as error:
        generate(secure_cluster.router_address, stranger_cert(tmp_path, certs.tls_ca))
    assert error.value.code == grpc.StatusCode.UNAVAILABLE


def http(url: str, key: str | None, body: dict | None = None) -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    data = None if body is None else json.dumps(body).encode()
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data, headers), timeout=60) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


COMPLETION = {"model": "distserve-tiny", "prompt": "hello", "max_tokens": 2}


@pytest.mark.parametrize("path, body", [("/v1/models", None), ("/v1/completions", COMPLETION), ("/metrics", None)])
@pytest.mark.parametrize("key", [None, "sk-wrong"])
def test_the_gateway_refuses_requests_without_the_api_key(secure_cluster, path, body, key):
    status, reply = http(secure_cluster.gateway_url + path, key, body)
    assert status == 401 and json.loads(reply)["error"]["code"] == "invalid_api_key"


def test_the_gateway_serves_with_the_api_key_over_mutual_tls_to_the_router(secure_cluster):
    status, reply = http(secure_cluster.gateway_url + "/v1/models", API_KEY)
    assert status == 200
    model = json.loads(reply)["data"][0]["id"]
    status, reply = http(secure_cluster.gateway_url + "/v1/completions", API_KEY, {**COMPLETION, "model": model})
    assert status == 200, reply
    assert json.loads(reply)["usage"]["completion_tokens"] == 2
    status, reply = http(secure_cluster.gateway_url + "/metrics", API_KEY)
    assert status == 200 and b"distserve:http_requests_total" in reply
    assert http(secure_cluster.gateway_url + "/health", None)[0] == 200  # probes need no key


def test_the_api_key_is_not_on_any_command_line(secure_cluster):
    for process in secure_cluster.processes.values():
        assert API_KEY not in " ".join(map(str, process.popen.args))


def test_a_worker_answers_the_router_and_the_operator_only(secure_cluster, certs):
    """Every child presents its role's certificate (the system above only works if the router's reaches the
    workers and the workers' reach the kvbroker); a certificate of another role is refused by a worker."""
    decode_address = secure_cluster.processes["decode-0"].address
    for role in ("gateway", "prefill"):
        with blocking_channel(decode_address, role_tls(certs, role)) as channel:
            with pytest.raises(grpc.RpcError) as refused:
                list(decode_pb2_grpc.DecodeServiceStub(channel).Decode(decode_pb2.DecodeRequest(), timeout=10))
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert f"role {role} may not call" in refused.value.details()
    with blocking_channel(decode_address, certs) as channel:  # the operator's: past the role check
        with pytest.raises(grpc.RpcError) as invalid:
            list(decode_pb2_grpc.DecodeServiceStub(channel).Decode(decode_pb2.DecodeRequest(), timeout=10))
    assert invalid.value.code() == grpc.StatusCode.INVALID_ARGUMENT
