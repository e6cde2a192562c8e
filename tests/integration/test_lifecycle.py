"""Service plumbing: health and reflection on every server; SIGTERM drains in-flight work."""

from __future__ import annotations

import threading

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from distserve.launcher import free_port
from tests.builders import token_request
from tests.integration.conftest import WORKER_LEASE_S, wait_for_workers
from distserve.v1 import router_pb2_grpc

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
        with grpc.insecure_channel(cluster.router_address) as channel:
            stream = router_pb2_grpc.RouterServiceStub(channel).Generate(
                token_request([30, 31, 32], max_tokens=400, ignore_eos=True), timeout=300)
            first = next(stream)
            assert first.decode_worker == spare_id
            terminated = threading.Thread(target=spare.popen.terminate)
            terminated.start()
            rest = list(stream)
            terminated.join()
        assert sum(len(m.token_ids) for m in [first, *rest]) == 400
        assert rest[-1].finish_reason == 2  # LENGTH: finished normally, not cut off
        assert spare.popen.wait(timeout=60) == 0
    finally:
        if spare.popen.poll() is None:
            cluster.kill("decode-drain")
        del cluster.processes["decode-drain"]
