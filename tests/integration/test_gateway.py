"""The OpenAI-compatible gateway against the real system: the openai SDK, raw SSE bytes, errors, disconnects.

Answers are compared with the router's own gRPC output for the same greedy request.
A second, small cluster (1 MiB of decode KV, API key set) provokes 429 and 503
without disturbing the shared one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import signal
import socket
import time

import aiohttp
import openai
import pytest

from distserve.engine.model_loader import load_tokenizer
from distserve.launcher import Cluster, ClusterSpec
from distserve.v1 import common_pb2, router_pb2
from tests.builders import generate, sampling, token_request
from tests.integration.conftest import leftover_state, wait_for_workers, worker_stats

MODEL = "distserve-tiny"
SMALL_MODEL = "distserve-small"  # small_cluster serves it
PROMPT = "def fibonacci(n):\n    return"
CHAT = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Sort a list."}]
FINISH = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length"}
API_KEY = "sk-small-cluster"


@pytest.fixture(scope="module")
def sdk(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.gateway_url + "/v1", api_key="any-key", max_retries=0)


@pytest.fixture(scope="module")
def chat_ids(tiny_model_path) -> list[int]:
    return list(load_tokenizer(tiny_model_path).apply_chat_template(
        CHAT, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])


def sdk_answer(create, stream: bool, chat: bool, **kwargs) -> tuple[str, str, object]:
    """(text, finish_reason, usage) of one SDK call; checks streaming chunk invariants on the way."""
    if not stream:
        reply = create(**kwargs)
        choice = reply.choices[0]
        return (choice.message.content if chat else choice.text), choice.finish_reason, reply.usage
    chunks = list(create(stream=True, stream_options={"include_usage": True}, **kwargs))
    choices = [c.choices[0] for c in chunks if c.choices]
    assert len({(c.id, c.created) for c in chunks}) == 1
    assert [c.finish_reason for c in choices[:-1]] == [None] * (len(choices) - 1)
    assert chunks[-1].choices == [] and all(c.usage is None for c in chunks[:-1])
    if chat:
        assert choices[0].delta.role == "assistant"
    text = "".join((c.delta.content or "") if chat else c.text for c in choices)
    return text, choices[-1].finish_reason, chunks[-1].usage


def assert_same_answer(got: tuple[str, str, object], ref) -> None:
    text, finish, usage = got
    assert ref.text and text == ref.text
    assert finish == FINISH[ref.last.finish_reason]
    assert (usage.prompt_tokens, usage.completion_tokens) == (ref.last.usage.prompt_tokens, len(ref.token_ids))
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_completion_equals_router_output(cluster, sdk, stream):
    ref = generate(cluster.router_address, router_pb2.GenerateRequest(text=PROMPT, sampling=sampling(max_tokens=24)))
    got = sdk_answer(sdk.completions.create, stream, chat=False, model=MODEL, prompt=PROMPT, max_tokens=24,
                     temperature=0)
    assert_same_answer(got, ref)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_equals_router_output_on_the_chat_template(cluster, sdk, chat_ids, stream):
    ref = generate(cluster.router_address, token_request(chat_ids, max_tokens=24))
    got = sdk_answer(sdk.chat.completions.create, stream, chat=True, model=MODEL, messages=CHAT,
                     max_completion_tokens=24, temperature=0)
    assert_same_answer(got, ref)


def test_token_prompt_seed_and_vllm_extras_reach_the_router(cluster, sdk):
    params = {"max_tokens": 16, "temperature": 0.8, "top_p": 0.9, "seed": 1234}
    extras = {"top_k": 40, "min_tokens": 4, "ignore_eos": True}
    ref = generate(cluster.router_address, token_request([7, 8, 9, 10], **params, **extras))
    got = sdk_answer(sdk.completions.create, False, chat=False, model=MODEL, prompt=[7, 8, 9, 10], **params,
                     extra_body=extras)
    assert_same_answer(got, ref)
    assert got[1] == "length" and got[2].completion_tokens == 16


def test_stop_string_ends_the_answer_and_is_not_returned(cluster, sdk):
    full = generate(cluster.router_address, router_pb2.GenerateRequest(text=PROMPT, sampling=sampling(max_tokens=24)))
    stop = full.text.strip()[6:9]
    ref = generate(cluster.router_address,
                   router_pb2.GenerateRequest(text=PROMPT, sampling=sampling(max_tokens=24, stop=[stop])))
    got = sdk_answer(sdk.completions.create, True, chat=False, model=MODEL, prompt=PROMPT, max_tokens=24,
                     temperature=0, stop=stop)
    assert_same_answer(got, ref)
    assert got[1] == "stop" and stop not in got[0] and full.text.startswith(got[0])


async def read_sse(url: str, body: dict, headers: dict) -> tuple[aiohttp.ClientResponse, bytes]:
    async with aiohttp.ClientSession() as session, session.post(url, json=body, headers=headers) as response:
        return response, await response.read()


@pytest.mark.parametrize("path, extra, kind, prefix", [
    ("/v1/completions", {"prompt": PROMPT}, "text_completion", "cmpl-"),
    ("/v1/chat/completions", {"messages": CHAT}, "chat.completion.chunk", "chatcmpl-"),
])
async def test_raw_sse_framing(cluster, path, extra, kind, prefix):
    request_id = f"sse-{prefix}{time.time_ns()}"
    body = {"model": MODEL, "max_tokens": 8, "ignore_eos": True, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **extra}
    response, raw = await read_sse(cluster.gateway_url + path, body, {"X-Request-Id": request_id})
    assert response.status == 200 and response.content_type == "text/event-stream"
    assert response.headers["X-Request-Id"] == request_id
    events = raw.split(b"\n\n")
    assert events[-2:] == [b"data: [DONE]", b""] and all(e.startswith(b"data: {") for e in events[:-2])
    chunks = [json.loads(e[len(b"data: "):]) for e in events[:-2]]
    assert {(c["id"], c["created"], c["object"], c["model"]) for c in chunks} == \
           {(prefix + request_id, chunks[0]["created"], kind, MODEL)}
    finishes = [c["choices"][0]["finish_reason"] for c in chunks[:-1]]
    assert finishes[-1] == "length" and finishes[:-1] == [None] * (len(finishes) - 1)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8
    assert all(c["usage"] is None for c in chunks[:-1])
    if kind == "chat.completion.chunk":
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert f"request_id={request_id}" in cluster.processes["router"].log_path.read_text()


ERRORS = [  # path, body (dict or raw bytes), status, param
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),  # the router's range check
    ("/v1/completions", {"prompt": "x", "temperature": -1, "stream": True}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [99999]}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": [5] * 3000}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 3000}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "n": 17}, 400, "n"),  # the router's bound (16)
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "("}}, 400, "structured_outputs"),
    ("/v1/completions", {"prompt": "x", "frobnicate": True}, 400, "frobnicate"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi " * 3000}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": -1}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
    ("/v1/completions", b'{"model": "distserve-tiny", "prompt": ', 400, None),
    ("/v1/completions", b'{"model": "distserve-tiny", "prompt": "\xff\xfe"}', 400, None),
    ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "model"),
]


async def post(url: str, body, headers: dict | None = None) -> tuple[int, dict, dict]:
    data = body if isinstance(body, bytes) else json.dumps({"model": MODEL, **body}).encode()
    async with aiohttp.ClientSession() as session, session.post(url, data=data, headers=headers or {}) as response:
        return response.status, dict(response.headers), await response.json()


@pytest.mark.parametrize("path, body, status, param", ERRORS)
async def test_errors_are_openai_error_objects(cluster, path, body, status, param):
    got_status, _, reply = await post(cluster.gateway_url + path, body)
    assert got_status == status, reply
    assert set(reply["error"]) == {"message", "type", "param", "code"}
    assert reply["error"]["param"] == param and reply["error"]["type"] == "invalid_request_error"
    assert param is None or param in reply["error"]["message"]


def test_sdk_raises_typed_errors(sdk):
    with pytest.raises(openai.BadRequestError) as info:
        sdk.completions.create(model=MODEL, prompt="x", temperature=-1)
    assert info.value.param == "temperature"
    with pytest.raises(openai.NotFoundError):
        sdk.chat.completions.create(model="gpt-4", messages=CHAT)


async def test_models_health_version(cluster, sdk):
    assert [m.id for m in sdk.models.list()] == [MODEL]
    async with aiohttp.ClientSession() as session:
        async with session.get(cluster.gateway_url + "/health") as response:
            assert response.status == 200 and (await response.json())["status"] == "ok"
        async with session.get(cluster.gateway_url + "/version") as response:
            assert (await response.json())["version"]


def aborted_upload(url: str) -> None:
    """A client that promises a body, sends part of it and hangs up."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"model\": ")


async def test_malformed_requests_do_not_disturb_a_concurrent_good_one(cluster):
    ref = generate(cluster.router_address, router_pb2.GenerateRequest(text=PROMPT, sampling=sampling(max_tokens=64)))
    url = cluster.gateway_url + "/v1/completions"
    good = asyncio.ensure_future(read_sse(url, {"model": MODEL, "prompt": PROMPT, "max_tokens": 64,
                                                "temperature": 0, "stream": True}, {}))
    bad = [body for path, body, _, _ in ERRORS if path == "/v1/completions"] * 3
    results = await asyncio.gather(*(post(url, b) for b in bad), asyncio.to_thread(aborted_upload, cluster.gateway_url))
    assert all(status in (400, 404) for status, _, _ in results[:-1])
    response, raw = await good
    events = [json.loads(e[len(b"data: "):]) for e in raw.split(b"\n\n")[:-2]]
    assert response.status == 200 and "".join(e["choices"][0]["text"] for e in events) == ref.text


def used_blocks(cluster: Cluster) -> list[int]:
    return [worker_stats(cluster, n).num_used_blocks for n in cluster.processes if n.startswith("decode")]


async def start_long_stream(session: aiohttp.ClientSession, url: str, headers: dict | None = None,
                            model: str = MODEL):
    """A long streaming request, read until two chunks arrived (decode is running)."""
    response = await session.post(url + "/v1/completions", headers=headers or {}, json={
        "model": model, "prompt": "hello", "max_tokens": 1500, "ignore_eos": True, "stream": True})
    assert response.status == 200
    for _ in range(2):
        assert (await response.content.readuntil(b"\n\n")).startswith(b"data: {")
    return response


async def test_disconnect_mid_stream_frees_decode_blocks_within_1s(cluster):
    async with aiohttp.ClientSession() as session:
        response = await start_long_stream(session, cluster.gateway_url)
        assert sum(used_blocks(cluster)) > 0
        response.close()  # drops the connection mid-stream
        closed = time.monotonic()
        while any(used_blocks(cluster)):
            assert time.monotonic() - closed < 1.0, used_blocks(cluster)
            await asyncio.sleep(0.01)


@pytest.fixture(scope="module")
def small_cluster(small_model_path, tmp_path_factory):
    """1 prefill, 1 decode with 128 KV blocks that waits 0.5 s for free blocks and reserves each request's
    whole life up front (so a request that cannot fit is refused, not admitted and preempted later; the
    growing path is tests/faults/test_preemption.py); the gateway needs API_KEY.

    The small model, not the tiny one: the tiny model decodes a 1500-token holder in ~1.5 s, too close to
    the ~0.6 s a refusal takes (a loaded CI box once saw the holder finish first and the request admitted)."""
    free_ports = {f.name: 0 for f in dataclasses.fields(ClusterSpec) if f.name.endswith("_port")}  # incl. gateway
    spec = ClusterSpec(model=small_model_path, **free_ports,
                       log_dir=str(tmp_path_factory.mktemp("small-logs")),
                       decode_args=["--kv-cache-mb", "32", "--admission-timeout-s", "0.5", "--reserve-ahead-tokens", "0"],
                       env={"DISTSERVE_DTYPE": "float32", "DISTSERVE_API_KEY": API_KEY})  # fp32 small: 256 KiB/block: 128 blocks
    small = Cluster(spec).start()
    wait_for_workers(small, 1, 1)
    yield small
    small.stop()


async def test_api_key_is_required_when_configured(small_cluster):
    url = small_cluster.gateway_url + "/v1/completions"
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        status, _, reply = await post(url, {"model": SMALL_MODEL, "prompt": "x"}, headers)
        assert status == 401 and reply["error"]["code"] == "invalid_api_key"
    status, _, reply = await post(url, {"model": SMALL_MODEL, "prompt": "x", "max_tokens": 2}, {"Authorization": f"Bearer {API_KEY}"})
    assert status == 200 and reply["usage"]["completion_tokens"] == 2
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=small_cluster.gateway_url + "/v1", api_key="wrong", max_retries=0).models.list()


async def test_out_of_kv_capacity_is_429_with_retry_after(small_cluster):
    auth = {"Authorization": f"Bearer {API_KEY}"}
    url = small_cluster.gateway_url + "/v1/completions"
    async with aiohttp.ClientSession() as session:
        holder = await start_long_stream(session, small_cluster.gateway_url, auth, SMALL_MODEL)  # holds 95 of 128 blocks
        big = {"model": SMALL_MODEL, "prompt": "hello", "max_tokens": 1000}
        (status, headers, reply), (_, raw) = await asyncio.gather(
            post(url, big, auth), read_sse(url, {"stream": True, **big}, auth))
        holder.close()
    assert status == 429 and headers["Retry-After"] == "1"
    assert (reply["error"]["type"], reply["error"]["code"]) == ("rate_limit_error", "rate_limit_exceeded")
    # Streaming had sent the first token already: the error comes in-band, then [DONE].
    events = raw.split(b"\n\n")
    assert events[-2:] == [b"data: [DONE]", b""]
    assert json.loads(events[-3][len(b"data: "):])["error"]["code"] == "rate_limit_exceeded"
    deadline = time.monotonic() + 5
    while any(v for v in leftover_state(small_cluster).values()):
        assert time.monotonic() < deadline, leftover_state(small_cluster)
        await asyncio.sleep(0.1)


async def health_problems(gateway_url: str) -> list[str]:
    async with aiohttp.ClientSession() as session, session.get(gateway_url + "/health") as response:
        body = await response.json()
        return [] if response.status == 200 else body["problems"]


async def test_no_decode_worker_then_no_router_is_503(small_cluster):
    url, auth = small_cluster.gateway_url + "/v1/completions", {"Authorization": f"Bearer {API_KEY}"}
    assert await health_problems(small_cluster.gateway_url) == []
    small_cluster.kill("decode-0", signal.SIGTERM)  # deregisters at once
    deadline = time.monotonic() + 10
    while (status := (await post(url, {"model": SMALL_MODEL, "prompt": "x"}, auth))[0]) != 503:
        assert status == 200 and time.monotonic() < deadline
        await asyncio.sleep(0.2)
    assert await health_problems(small_cluster.gateway_url) == ["no decode worker is registered"]
    small_cluster.kill("router", signal.SIGTERM)
    status, _, reply = await post(url, {"model": SMALL_MODEL, "prompt": "x"}, auth)
    assert status == 503 and reply["error"]["code"] == "service_unavailable"
    assert any("router" in p and "unreachable" in p for p in await health_problems(small_cluster.gateway_url))
