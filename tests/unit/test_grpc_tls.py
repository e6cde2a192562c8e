"""Mutual TLS in distserve.grpc_server, in-process: a real server with bind() and real channels.

With TLS a server answers only clients that present a certificate from its CA; the settings
are all three files or none, and a missing or unreadable file is a ConfigError naming it.
"""

from __future__ import annotations

import dataclasses

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from distserve.config import ConfigError, parse_config
from distserve.dev_certs import make_ca, make_dev_certs, make_signed_cert
from distserve.grpc_server import PLAINTEXT, TlsConfig, aio_channel, bind
from services.router.config import RouterConfig


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> TlsConfig:
    return make_dev_certs(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def stranger(tmp_path_factory) -> TlsConfig:
    """A certificate from another CA, trusting the real CA: a client the server must refuse."""
    folder = tmp_path_factory.mktemp("stranger")
    make_ca(folder / "ca.pem", folder / "ca-key.pem", days=1, name="other-ca")
    make_signed_cert(folder / "ca.pem", folder / "ca-key.pem", folder / "cert.pem", folder / "key.pem", days=1)
    return TlsConfig(tls_cert=str(folder / "cert.pem"), tls_key=str(folder / "key.pem"), tls_ca="")


async def health_check(address: str, tls: TlsConfig) -> int:
    async with aio_channel(address, tls) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return reply.status


async def test_a_tls_server_answers_only_clients_with_a_certificate_from_its_ca(certs, stranger):
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = bind(server, "127.0.0.1:0", certs)
    await server.start()
    address = f"127.0.0.1:{port}"
    try:
        assert await health_check(address, certs) == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.aio.AioRpcError) as plaintext:
            await health_check(address, PLAINTEXT)
        assert plaintext.value.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.aio.AioRpcError) as other_ca:
            await health_check(address, dataclasses.replace(stranger, tls_ca=certs.tls_ca))
        assert other_ca.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop(0)


def test_tls_settings_are_flags_and_shared_env_vars(certs, monkeypatch):
    monkeypatch.setenv("DISTSERVE_TLS_CA", certs.tls_ca)
    monkeypatch.setenv("DISTSERVE_TLS_KEY", certs.tls_key)
    config = parse_config(RouterConfig, ["--tls-cert", certs.tls_cert], prefix="DISTSERVE_ROUTER_")
    assert config.is_tls and config.tls_pem()[0].startswith(b"-----BEGIN CERTIFICATE")
    assert certs.tls_env() == {"DISTSERVE_TLS_CERT": certs.tls_cert, "DISTSERVE_TLS_KEY": certs.tls_key,
                               "DISTSERVE_TLS_CA": certs.tls_ca}
    assert not RouterConfig().is_tls and PLAINTEXT.tls_env() == {}


def test_half_set_or_unreadable_tls_settings_name_the_field(certs, tmp_path):
    with pytest.raises(ConfigError, match="^tls_ca: required"):
        TlsConfig(tls_cert=certs.tls_cert, tls_key=certs.tls_key).tls_pem()
    with pytest.raises(ConfigError, match="^tls_key: cannot read"):
        TlsConfig(tls_cert=certs.tls_cert, tls_key=str(tmp_path / "nope"), tls_ca=certs.tls_ca).tls_pem()
