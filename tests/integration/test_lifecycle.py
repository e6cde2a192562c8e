"""Service plumbing: health and reflection on every server; SIGTERM drains in-flight work."""

from __future__ import annotations

import socket
import struct
import subprocess
import threading
import time
import urllib.parse
from pathlib import Path

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from distserve import cli
from distserve.client import DistServeSyncClient, FinishReason
from distserve.launcher import Cluster, ClusterSpec, StartError, find_redis_server, free_port
from tests.integration.conftest import WORKER_LEASE_S, wait_for_workers
from distserve.v1 import common_pb2, kvbroker_pb2, kvbroker_pb2_grpc

SERVICE_OF = {"router": "distserve.v1.RouterService", "kvbroker": "distserve.v1.KvBrokerService",
              "prefill-0": "distserve.v1.PrefillService", "decode-0": "distserve.v1.DecodeService"}


def test_every_server_serves_health_and_reflection(cluster):
    for name, service in SERVICE_OF.items():
        with grpc.insecure_channel(cluster.processes[name].address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for target in ("", service):
                reply = health.Check(health_pb2.HealthCheckRequest(service=target), timeout=10)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
            services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
            assert {service, "grpc.health.v1.Health"} <= services, services


def test_sigterm_lets_an_in_flight_stream_finish(cluster):
    # A decode worker with more free blocks than the others: the router prefers it when all are idle.
    port = free_port()
    args = ["--lease-s", str(WORKER_LEASE_S), "--heartbeat-s", "0.5", "--kv-cache-mb", "128"]
    spare = cluster.start_service("decode-drain", "services.decode", f"127.0.0.1:{port}", args)
    cluster.wait_healthy(spare, 120)
    wait_for_workers(cluster, 2, 3)
    spare_id = f"decode-127.0.0.1-{port}"
    try:
        with DistServeSyncClient(cluster.router_address, timeout_s=300) as client:
            stream = client.generate([30, 31, 32], max_tokens=400, temperature=0, ignore_eos=True)
            first = next(stream)
            assert first.decode_worker == spare_id
            terminated = threading.Thread(target=spare.popen.terminate)
            terminated.start()
            rest = list(stream)
            terminated.join()
        assert sum(len(c.token_ids) for c in [first, *rest]) == 400
        assert rest[-1].finish_reason is FinishReason.LENGTH  # finished normally, not cut off
        assert spare.popen.wait(timeout=60) == 0
    finally:
        if spare.popen.poll() is None:
            cluster.kill("decode-drain")
        del cluster.processes["decode-drain"]


def test_streams_still_running_when_the_drain_ends_move_to_another_worker(cluster):
    """SIGTERM with a short grace (--grace-s): what has not finished when it ends moves to another decode
    worker (migration) with unchanged output, and the drained worker exits 0."""
    port = free_port()
    # The stream must outlive drain + grace by a wide margin on any machine: 2,000 tokens take the tiny model
    # about a second here (0.5 ms a step), and a machine twice as fast still needs 0.5 s against 0.2 s.
    args = ["--lease-s", str(WORKER_LEASE_S), "--heartbeat-s", "0.5", "--kv-cache-mb", "128", "--grace-s", "0.1",
            "--drain-s", "0.1"]
    prompt, max_tokens = [40, 41, 42], 2000
    with DistServeSyncClient(cluster.router_address, timeout_s=300) as client:
        unfailed = [t for c in client.generate(prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True)
                    for t in c.token_ids]
    spare = cluster.start_service("decode-short-drain", "services.decode", f"127.0.0.1:{port}", args)
    cluster.wait_healthy(spare, 120)
    wait_for_workers(cluster, 2, 3)
    try:
        with DistServeSyncClient(cluster.router_address, timeout_s=300) as client:
            stream = client.generate(prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True)
            chunks = [next(stream)]
            assert chunks[0].decode_worker == f"decode-127.0.0.1-{port}"
            spare.popen.terminate()
            chunks += list(stream)
        assert [t for c in chunks for t in c.token_ids] == unfailed
        assert any(c.decode_worker and c.decode_worker != chunks[0].decode_worker for c in chunks[1:])  # moved
        assert spare.popen.wait(timeout=60) == 0
    finally:
        if spare.popen.poll() is None:
            cluster.kill("decode-short-drain")
        del cluster.processes["decode-short-drain"]


PASSWORD = "n0t-f0r-y0ur-eyes"


@pytest.fixture
def tls_redis(tmp_path):
    """A redis-server speaking only TLS and requiring a password; yields its rediss:// URL."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    port = free_port()
    server = subprocess.Popen([find_redis_server(), "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
                               "--tls-cert-file", str(cert), "--tls-key-file", str(key), "--tls-ca-cert-file",
                               str(cert), "--tls-auth-clients", "no", "--requirepass", PASSWORD, "--save", "",
                               "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"rediss://:{PASSWORD}@127.0.0.1:{port}/0?ssl_ca_certs={cert}&ssl_cert_reqs=required"
    client = redis.Redis.from_url(url)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline and server.poll() is None, "TLS redis-server did not start"
                time.sleep(0.1)
        yield url
    finally:
        client.close()
        server.terminate()
        server.wait(timeout=10)


def test_children_use_a_tls_redis_with_a_password_and_never_show_it(tiny_model_path, tmp_path, tls_redis, capsys):
    spec = ClusterSpec(model=tiny_model_path, num_prefill=0, num_decode=0, gateway_port=None, redis_url=tls_redis,
                       router_port=0, broker_port=0, metrics_base_port=0, log_dir=str(tmp_path / "logs"),
                       state_file=str(tmp_path / "up.json"), supervise=True)
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(tls_redis.replace(PASSWORD, "wrong")).ping()
    cluster = Cluster(spec).start()
    try:
        # The kvbroker writes a handle to the TLS Redis with the password; the router reads the registry.
        handle = kvbroker_pb2.KvHandle(handle_id="tls-check", request_id="r", owner_worker_id="w",
                                       owner_ucx_address="127.0.0.1:1", layout=common_pb2.KvLayout(num_bytes=1))
        with grpc.insecure_channel(cluster.broker_address) as channel:
            kvbroker_pb2_grpc.KvBrokerServiceStub(channel).RegisterHandle(
                kvbroker_pb2.RegisterHandleRequest(handle=handle, lease_s=30), timeout=10)
            assert redis.Redis.from_url(tls_redis).keys("distserve:kv:*")
            kvbroker_pb2_grpc.KvBrokerServiceStub(channel).ReleaseHandle(
                kvbroker_pb2.ReleaseHandleRequest(handle_id="tls-check"), timeout=10)
        time.sleep(1.5)  # a few router registry refreshes
        assert "registry refresh failed" not in cluster.processes["router"].log_tail(200)
        cli._print_addresses(cluster)
        banner = capsys.readouterr().out
        argvs = [Path(f"/proc/{p.popen.pid}/cmdline").read_bytes().decode() for p in cluster.processes.values()]
        state = Path(spec.state_file).read_text()
    finally:
        cluster.stop()
    logs = [path.read_text(errors="replace") for path in Path(spec.log_dir).iterdir()]
    assert "rediss://:***@127.0.0.1" in banner and "rediss://:***@127.0.0.1" in state
    for text in [banner, state, *argvs, *logs]:
        assert PASSWORD not in text


def _control_plane_only(tiny_model_path, tmp_path, redis_port: int) -> ClusterSpec:
    return ClusterSpec(model=tiny_model_path, num_prefill=0, num_decode=0, gateway_port=None, redis_port=redis_port,
                       router_port=0, broker_port=0, metrics_base_port=0, log_dir=str(tmp_path / "logs"))


def test_a_fixed_port_held_by_a_connection_is_waited_for(tiny_model_path, tmp_path):
    """A fixed port (`up`'s defaults 50051-50090 lie inside Linux's ephemeral range) can be some connection's
    local end when a child comes to bind it: the launcher starts the child again on the same port."""
    port = free_port()
    peer = socket.create_server(("127.0.0.1", 0))
    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close: reset, no TIME_WAIT
    holder.bind(("127.0.0.1", port))
    holder.connect(peer.getsockname())  # `port` is this connection's local end; nothing listens there
    releaser = threading.Timer(1.5, holder.close)
    releaser.start()
    cluster = Cluster(_control_plane_only(tiny_model_path, tmp_path, port))
    try:
        cluster.start(timeout_s=60)
        assert urllib.parse.urlsplit(cluster.redis_url).port == port
        assert cluster.processes["redis"].port_waits >= 1
        assert redis.Redis.from_url(cluster.redis_url).ping()
    finally:
        cluster.stop()
        releaser.join()
        peer.close()


def test_a_fixed_port_a_server_listens_on_fails_the_start_at_once(tiny_model_path, tmp_path):
    port = free_port()
    with socket.create_server(("127.0.0.1", port)):
        cluster = Cluster(_control_plane_only(tiny_model_path, tmp_path, port))
        with pytest.raises(StartError, match="Its port is taken"):
            cluster.start(timeout_s=60)
    assert cluster.processes["redis"].port_waits == 0
