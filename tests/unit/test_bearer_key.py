"""The router API's bearer key: calls without it are UNAUTHENTICATED before any handler runs; health
checks stay open; the config takes the key from the environment or a file, never a flag."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from distserve.bearer_key import BearerKeyInterceptor, call_metadata
from distserve.config import ConfigError, parse_config
from distserve.v1 import router_pb2, router_pb2_grpc
from services.router.config import RouterConfig

KEY = "sk-router-test"


class CountingRouter(router_pb2_grpc.RouterServiceServicer):
    """A fake router: Tokenize answers and counts; Generate streams one message."""

    def __init__(self):
        self.calls = 0

    async def Tokenize(self, request, context):
        self.calls += 1
        return router_pb2.TokenizeResponse(token_ids=[1, 2])

    async def Generate(self, request, context):
        self.calls += 1
        yield router_pb2.GenerateResponse(token_ids=[7])


async def test_only_calls_presenting_the_key_reach_the_router_and_health_stays_open():
    server = grpc.aio.server(interceptors=[BearerKeyInterceptor(KEY)])
    router = CountingRouter()
    router_pb2_grpc.add_RouterServiceServicer_to_server(router, server)
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = router_pb2_grpc.RouterServiceStub(channel)
            for metadata in (None, call_metadata("sk-wrong"), (("authorization", KEY),)):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.Tokenize(router_pb2.TokenizeRequest(text="x"), metadata=metadata)
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    [m async for m in stub.Generate(router_pb2.GenerateRequest(), metadata=metadata)]
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert router.calls == 0, "a refused call never reaches a handler"
            assert list((await stub.Tokenize(router_pb2.TokenizeRequest(text="x"),
                                             metadata=call_metadata(KEY))).token_ids) == [1, 2]
            assert [list(m.token_ids) async for m in stub.Generate(router_pb2.GenerateRequest(),
                                                                    metadata=call_metadata(KEY))] == [[7]]
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await server.stop(0)


def test_no_key_no_metadata_and_an_empty_key_admits_no_one():
    assert call_metadata("") is None
    with pytest.raises(ValueError):
        BearerKeyInterceptor("")


def test_the_router_takes_the_key_from_the_environment_or_a_file_never_a_flag(monkeypatch, tmp_path):
    monkeypatch.setenv("DISTSERVE_API_KEY", KEY)
    assert parse_config(RouterConfig, [], prefix="DISTSERVE_ROUTER_").api_key == KEY
    monkeypatch.delenv("DISTSERVE_API_KEY")
    with pytest.raises(SystemExit):
        parse_config(RouterConfig, ["--api-key", KEY], prefix="DISTSERVE_ROUTER_")
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    config = parse_config(RouterConfig, ["--api-key-file", str(key_file)], prefix="DISTSERVE_ROUTER_")
    assert config.with_api_key_from_file().api_key == KEY
    with pytest.raises(ConfigError, match="^api_key_file: set either"):
        RouterConfig(api_key="a", api_key_file=str(key_file))


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "::", "router.internal"])
def test_a_router_or_gateway_on_a_non_loopback_host_needs_a_key_tls_or_an_explicit_flag(host):
    from services.router.gateway.config import GatewayConfig

    tls = dict(tls_cert="c.pem", tls_key="k.pem", tls_ca="ca.pem")
    for config in (RouterConfig, GatewayConfig):
        with pytest.raises(ConfigError, match="^host: .* is not a loopback address"):
            config(host=host)
        config(host=host, api_key=KEY)
        config(host=host, allow_unauthenticated=True)
    RouterConfig(host=host, **tls)  # mutual TLS guards the router's gRPC port
    with pytest.raises(ConfigError, match="^host:"):
        GatewayConfig(host=host, **tls)  # the gateway's TLS is to the router: its HTTP port stays open


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"])
def test_loopback_hosts_need_nothing(host):
    RouterConfig(host=host)
