"""distserve.peer_roles and the per-role certificates of distserve.dev_certs, on a real TLS server in-process:
a worker's API answers the router and the operator, refuses other roles and certificates naming none, and
leaves health checks open to any certificate from the CA."""

from __future__ import annotations

import stat
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from distserve.dev_certs import ca_key_path, make_ca, make_dev_certs, make_signed_cert, role_tls
from distserve.grpc_server import PLAINTEXT, TlsConfig, aio_channel, bind
from distserve.peer_roles import ROLES, WORKER_CALLERS, PeerRoleInterceptor
from services.colocated.config import ColocatedConfig
from services.decode.config import DecodeConfig
from services.kvbroker.config import KvBrokerConfig
from services.prefill.config import PrefillConfig
from services.router.config import RouterConfig
from services.router.gateway.config import GatewayConfig


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> TlsConfig:
    return make_dev_certs(tmp_path_factory.mktemp("tls") / "certs")


def test_every_role_has_its_certificate_and_the_ca_key_is_outside_the_folder(certs):
    folder = certs.tls_ca.rpartition("/")[0]
    key = ca_key_path(folder)
    assert key.exists() and not key.is_relative_to(folder)
    assert stat.S_IMODE(key.stat().st_mode) == 0o600 and stat.S_IMODE(key.parent.stat().st_mode) == 0o700
    for role in ROLES:
        tls = role_tls(certs, role)
        assert tls.tls_cert.endswith(f"roles/{role}.pem") and tls.tls_check_roles and tls.tls_ca == certs.tls_ca
    assert role_tls(PLAINTEXT, "router") == PLAINTEXT
    assert not any(path.name.startswith("ca-key") for path in Path(folder).rglob("*"))


def test_one_certificate_for_all_stays_as_it_is(tmp_path):
    make_ca(tmp_path / "ca.pem", tmp_path / "ca-key.pem", days=1)
    make_signed_cert(tmp_path / "ca.pem", tmp_path / "ca-key.pem", tmp_path / "cert.pem", tmp_path / "key.pem", days=1)
    shared = TlsConfig(tls_cert=str(tmp_path / "cert.pem"), tls_key=str(tmp_path / "key.pem"),
                       tls_ca=str(tmp_path / "ca.pem"))
    assert role_tls(shared, "decode") == shared


async def _say(request: bytes, context) -> bytes:
    return b"said " + request


async def _count(request: bytes, context):
    for i in range(3):
        yield bytes([i])


@pytest.fixture
async def worker_server(certs):
    """A server that serves as a worker does: its own role certificate, roles checked, health open."""
    tls = role_tls(certs, "decode")
    server = grpc.aio.server(interceptors=[PeerRoleInterceptor(WORKER_CALLERS)])
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("test.Worker", {
        "Say": grpc.unary_unary_rpc_method_handler(_say), "Count": grpc.unary_stream_rpc_method_handler(_count)})])
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = bind(server, "127.0.0.1:0", tls)
    await server.start()
    yield f"127.0.0.1:{port}"
    await server.stop(0)


async def _calls(address: str, tls: TlsConfig) -> tuple[bytes, list[bytes]]:
    async with aio_channel(address, tls) as channel:
        said = await channel.unary_unary("/test.Worker/Say")(b"hi", timeout=5)
        counted = [m async for m in channel.unary_stream("/test.Worker/Count")(b"", timeout=5)]
        return said, counted


@pytest.mark.parametrize("role", ["router", "admin"])
async def test_the_router_and_the_operator_may_call_a_worker(worker_server, certs, role):
    tls = certs if role == "admin" else role_tls(certs, role)
    assert await _calls(worker_server, tls) == (b"said hi", [b"\x00", b"\x01", b"\x02"])


@pytest.mark.parametrize("role", ["gateway", "prefill", "kvbroker", None])
async def test_other_roles_and_certificates_naming_none_are_refused(worker_server, certs, tmp_path, role):
    if role is None:  # signed by the same CA, with no role in its subject
        folder = certs.tls_ca.rpartition("/")[0]
        make_signed_cert(certs.tls_ca, ca_key_path(folder), tmp_path / "c.pem", tmp_path / "k.pem", days=1)
        tls = TlsConfig(tls_cert=str(tmp_path / "c.pem"), tls_key=str(tmp_path / "k.pem"), tls_ca=certs.tls_ca)
    else:
        tls = role_tls(certs, role)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await _calls(worker_server, tls)
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert f"role {role or '(none)'} may not call" in refused.value.details()
    async with aio_channel(worker_server, tls) as channel:  # health stays open to any certificate of the CA
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_no_allowed_role_is_a_mistake():
    with pytest.raises(ValueError):
        PeerRoleInterceptor(frozenset())


SERVICE_CONFIGS = {"router": RouterConfig, "gateway": GatewayConfig, "kvbroker": KvBrokerConfig,
                   "prefill": PrefillConfig, "decode": DecodeConfig, "colocated": ColocatedConfig}


def test_tls_dir_gives_each_service_its_roles_certificate_with_roles_checked(certs):
    """What compose passes (DISTSERVE_TLS_DIR): each service's config picks its own role's files."""
    folder = certs.tls_ca.rpartition("/")[0]
    assert set(SERVICE_CONFIGS) == set(ROLES)
    for role, config_class in SERVICE_CONFIGS.items():
        config = config_class(tls_dir=folder)
        expected = role_tls(certs, role)
        assert (config.tls_cert, config.tls_key, config.tls_ca) == (expected.tls_cert, expected.tls_key, certs.tls_ca)
        assert config.tls_check_roles and all(Path(p).exists() for p in (config.tls_cert, config.tls_key))
        assert "DISTSERVE_TLS_DIR" not in config.tls_env()  # a child gets the files, not the folder
    assert TlsConfig(tls_dir=folder).tls_cert == certs.tls_cert  # no service: the operator's
    mine = DecodeConfig(tls_dir=folder, tls_cert=certs.tls_cert, tls_key=certs.tls_key)
    assert mine.tls_cert == certs.tls_cert and mine.tls_ca == certs.tls_ca  # files given win


async def test_services_configured_by_tls_dir_call_as_their_roles(worker_server, certs):
    folder = certs.tls_ca.rpartition("/")[0]
    assert await _calls(worker_server, RouterConfig(tls_dir=folder)) == (b"said hi", [b"\x00", b"\x01", b"\x02"])
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await _calls(worker_server, GatewayConfig(tls_dir=folder))
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
