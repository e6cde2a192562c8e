"""services.router.gateway.limits: per-client token buckets, the connection cap, header and body deadlines.

Buckets run on a fake clock; the server guards on a real aiohttp server over loopback, with raw sockets
playing the slow or greedy clients."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer, make_mocked_request

from distserve.engine.model_loader import load_tokenizer
from distserve.launcher import free_port
from services.router.gateway.app import create_app, error_middleware
from services.router.gateway.chat_template import ChatTemplate
from services.router.gateway.config import GatewayConfig
from services.router.gateway.limits import GuardedRunner, TokenBuckets, body_deadline_middleware, client_of


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_bucket_grants_its_burst_then_one_request_per_refill():
    clock = Clock()
    buckets = TokenBuckets(2.0, burst=3, clock=clock)
    assert [buckets.take("a") for _ in range(3)] == [0.0, 0.0, 0.0]
    assert buckets.take("a") == pytest.approx(0.5)  # one token every 0.5 s
    assert buckets.take("b") == 0.0  # another client has its own bucket
    clock.now += 0.25
    assert buckets.take("a") == pytest.approx(0.25)
    clock.now += 0.25
    assert buckets.take("a") == 0.0
    clock.now += 60
    assert [buckets.take("a") for _ in range(4)][-1] > 0  # refilled to the burst, no further


def test_full_buckets_are_forgotten_when_too_many_are_kept(monkeypatch):
    monkeypatch.setattr("services.router.gateway.limits.MAX_TRACKED_CLIENTS", 2)
    clock = Clock()
    buckets = TokenBuckets(1.0, burst=1, clock=clock)
    buckets.take("old")
    clock.now += 5  # "old" has refilled
    buckets.take("x")
    buckets.take("y")
    assert set(buckets._buckets) == {"x", "y"}


@pytest.mark.parametrize("rate, burst", [(0, 1), (1, 0), (-1, 2)])
def test_bucket_sizes_are_checked(rate, burst):
    with pytest.raises(ValueError):
        TokenBuckets(rate, burst)


def test_a_client_is_its_key_else_its_address():
    keyed = make_mocked_request("POST", "/v1/completions", headers={"Authorization": "Bearer sk-one"})
    other = make_mocked_request("POST", "/v1/completions", headers={"Authorization": "Bearer sk-two"})
    assert client_of(keyed).startswith("key:") and client_of(keyed) != client_of(other)
    assert "sk-one" not in client_of(keyed)
    assert client_of(make_mocked_request("POST", "/v1/completions")).startswith("addr:")


@pytest.fixture(scope="module")
def template(tiny_model_path) -> ChatTemplate:
    return ChatTemplate(load_tokenizer(tiny_model_path))


async def test_past_its_bucket_a_client_gets_429_with_retry_after(template):
    config = GatewayConfig(router_address=f"127.0.0.1:{free_port()}", redis_url=f"redis://127.0.0.1:{free_port()}/0",
                           rate_limit_rps=0.5, rate_limit_burst=2)
    async with TestClient(TestServer(create_app(config, template, "m"))) as client:
        one = {"Authorization": "Bearer sk-one"}
        for _ in range(2):  # a broken body is still a request: it is counted, then refused with 400
            assert (await client.post("/v1/completions", headers=one, data=b"{")).status == 400
        reply = await client.post("/v1/completions", headers=one, data=b"{")
        assert reply.status == 429 and reply.headers["Retry-After"] == "2"
        error = (await reply.json())["error"]
        assert error["code"] == "rate_limit_exceeded" and error["type"] == "rate_limit_error"
        other = {"Authorization": "Bearer sk-two"}
        assert (await client.post("/v1/chat/completions", headers=other, data=b"{")).status == 400
        assert (await client.get("/v1/models", headers=one)).status == 200  # not a generation path


@pytest.fixture
async def guarded_server():
    """A real server: 2 connections at most, 0.3 s for the first request's headers, 0.3 s for a body."""
    async def echo(request: web.Request) -> web.Response:
        return web.Response(body=await request.read())

    app = web.Application(middlewares=[error_middleware, body_deadline_middleware(0.3)])
    app.router.add_post("/", echo)
    runner = GuardedRunner(app, max_connections=2, header_timeout_s=0.3)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield port, runner.guard
    await runner.cleanup()


async def closed_within(reader: asyncio.StreamReader, timeout_s: float) -> bool:
    try:
        return await asyncio.wait_for(reader.read(), timeout_s) == b""
    except asyncio.TimeoutError:
        return False


async def test_a_connection_over_the_cap_is_closed_at_once(guarded_server):
    port, guard = guarded_server
    held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    assert await closed_within(reader, 0.2)
    assert guard.num_refused == 1
    for _, held_writer in held:
        held_writer.close()


async def test_a_connection_without_headers_is_closed_at_the_deadline_and_a_served_one_is_not(guarded_server):
    port, _ = guarded_server
    silent_reader, silent = await asyncio.open_connection("127.0.0.1", port)
    silent.write(b"POST / HTTP/1.1\r\nHost: x\r\n")  # headers never finished
    served_reader, served = await asyncio.open_connection("127.0.0.1", port)
    served.write(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhi")
    assert (await served_reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
    assert not await closed_within(silent_reader, 0.1)
    assert await closed_within(silent_reader, 1.0)
    assert not await closed_within(served_reader, 0.5)  # a kept-alive connection past the deadline stays
    served.close()


async def test_a_body_slower_than_its_deadline_gets_408(guarded_server):
    port, _ = guarded_server
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nab")  # 8 bytes never come
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 2.0)
    assert head.startswith(b"HTTP/1.1 408")
    writer.close()
