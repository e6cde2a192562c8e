"""The gateway's HTTP edge in-process: routes, API key, request ids, error objects, config.

The router and Redis addresses point at closed ports, so these run without the
system; what needs the system is in tests/integration/test_gateway.py.
"""

from __future__ import annotations

import pytest
from aiohttp.test_utils import TestClient, TestServer

import distserve
from distserve.config import ConfigError, parse_config
from distserve.engine.model_loader import load_tokenizer
from distserve.launcher import free_port
from services.router.gateway.app import create_app
from services.router.gateway.chat_template import ChatTemplate
from services.router.gateway.config import GatewayConfig

MODEL = "distserve-tiny"
KEY = "sk-test"


@pytest.fixture(scope="module")
def template(tiny_model_path) -> ChatTemplate:
    return ChatTemplate(load_tokenizer(tiny_model_path))


@pytest.fixture
async def client(template):
    config = GatewayConfig(router_address=f"127.0.0.1:{free_port()}", redis_url=f"redis://127.0.0.1:{free_port()}/0",
                           api_key=KEY, max_body_mb=0.01, health_timeout_s=0.5)
    async with TestClient(TestServer(create_app(config, template, MODEL))) as test_client:
        yield test_client


AUTH = {"Authorization": f"Bearer {KEY}"}


async def error_of(response, status: int) -> dict:
    assert response.status == status, await response.text()
    body = await response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


async def test_version_and_models(client):
    reply = await client.get("/version")
    assert reply.status == 200 and (await reply.json()) == {"version": distserve.__version__}
    reply = await client.get("/v1/models", headers=AUTH)
    assert [m["id"] for m in (await reply.json())["data"]] == [MODEL]
    reply = await client.get(f"/v1/models/{MODEL}", headers=AUTH)
    assert (await reply.json())["id"] == MODEL
    error = await error_of(await client.get("/v1/models/other", headers=AUTH), 404)
    assert error["code"] == "model_not_found"


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                                     {"Authorization": f"Basic {KEY}"}])
async def test_a_configured_api_key_is_required_on_v1_and_metrics(client, headers):
    for path in ("/v1/models", "/metrics"):
        error = await error_of(await client.get(path, headers=headers), 401)
        assert error["code"] == "invalid_api_key"
    assert (await client.get("/version")).status == 200  # not under /v1
    reply = await client.get("/metrics", headers=AUTH)
    assert reply.status == 200 and "distserve:http_requests_total" in await reply.text()


async def test_aiohttp_errors_become_error_objects(client):
    error = await error_of(await client.get("/v1/nowhere", headers=AUTH), 404)
    assert "/v1/nowhere" in error["message"]
    await error_of(await client.get("/v1/completions", headers=AUTH), 405)
    error = await error_of(await client.post("/v1/completions", headers=AUTH, data=b"x" * 20000), 413)
    assert error["code"] == "request_too_large"


async def test_request_id_is_echoed_or_generated(client):
    reply = await client.post("/v1/completions", headers={**AUTH, "X-Request-Id": "abc-123"}, data=b"{")
    assert reply.status == 400 and reply.headers["X-Request-Id"] == "abc-123"
    reply = await client.get("/version")
    assert len(reply.headers["X-Request-Id"]) == 32
    error = await error_of(await client.post("/v1/completions", headers={**AUTH, "X-Request-Id": "x" * 200},
                                             json={"model": MODEL, "prompt": "hi"}), 400)
    assert "X-Request-Id" in error["message"]


async def test_bad_bodies_are_rejected_before_the_router(client):
    error = await error_of(await client.post("/v1/completions", headers=AUTH, data=b"\xff"), 400)
    assert "UTF-8" in error["message"]
    error = await error_of(await client.post("/v1/chat/completions", headers=AUTH,
                                             json={"model": "gpt-4", "messages": []}), 404)
    assert error["param"] == "model"
    error = await error_of(await client.post("/v1/completions", headers=AUTH,
                                             json={"model": MODEL, "prompt": "x", "temperature": "hot"}), 400)
    assert error["param"] == "temperature"


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"model": MODEL, "prompt": "hi"}),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "stream": True}),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}),
])
async def test_an_unreachable_router_is_503(client, path, body):
    error = await error_of(await client.post(path, headers=AUTH, json=body), 503)
    assert error["type"] == "server_error" and error["code"] == "service_unavailable"


async def test_health_is_503_and_says_why(client):
    reply = await client.get("/health")
    assert reply.status == 503
    problems = (await reply.json())["problems"]
    assert any("router" in p and "unreachable" in p for p in problems)
    assert any("registry unreachable" in p for p in problems)


async def test_live_answers_200_while_health_is_503_and_needs_no_key(client):
    """Liveness is the process alone: nothing reachable behind it, no key presented, and still 200."""
    reply = await client.get("/live")
    assert reply.status == 200 and (await reply.json()) == {"status": "live"}
    assert (await client.get("/health")).status == 503


def test_config_flags_env_and_validation(monkeypatch):
    monkeypatch.setenv("DISTSERVE_API_KEY", "from-env")
    monkeypatch.setenv("DISTSERVE_ROUTER_ADDRESS", "10.0.0.1:1")
    config = parse_config(GatewayConfig, ["--port", "9000", "--served-model-name", "m"], prefix="DISTSERVE_GATEWAY_")
    assert (config.port, config.served_model_name, config.api_key, config.router_address) == \
           (9000, "m", "from-env", "10.0.0.1:1")
    with pytest.raises(ConfigError, match="^port:"):
        GatewayConfig(port=70000)
    with pytest.raises(ConfigError, match="^request_timeout_s:"):
        GatewayConfig(request_timeout_s=0)


def test_the_api_key_is_not_a_flag(capsys):
    with pytest.raises(SystemExit):
        parse_config(GatewayConfig, ["--api-key", "sk-visible-to-ps"], prefix="DISTSERVE_GATEWAY_")
    assert "unrecognized arguments: --api-key" in capsys.readouterr().err


def test_the_api_key_is_read_from_a_file(tmp_path, monkeypatch):
    monkeypatch.delenv("DISTSERVE_API_KEY", raising=False)
    key_file = tmp_path / "key"
    key_file.write_text("sk-from-file\n")
    config = parse_config(GatewayConfig, ["--api-key-file", str(key_file)], prefix="DISTSERVE_GATEWAY_")
    assert config.with_api_key_from_file().api_key == "sk-from-file"
    with pytest.raises(ConfigError, match="^api_key_file: cannot read"):
        GatewayConfig(api_key_file=str(tmp_path / "missing")).with_api_key_from_file()
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="^api_key_file: .* is empty"):
        GatewayConfig(api_key_file=str(tmp_path / "empty")).with_api_key_from_file()
    with pytest.raises(ConfigError, match="^api_key_file: set either"):
        GatewayConfig(api_key="a", api_key_file=str(key_file))
