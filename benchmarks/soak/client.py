"""Sending one planned request to the gateway and recording what came back, without judging it.

Streams are read event by event: text, finish_reason, the usage chunk
(stream_options.include_usage), an in-band error event, and [DONE]. Connections
are not reused (a gateway killed mid-run leaves no stale pooled connection behind).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from urllib.parse import urlsplit

import aiohttp

from benchmarks.soak.workload import Planned


@dataclasses.dataclass
class Outcome:
    """What the client saw. `status` None: no HTTP answer (connection failed, hang, or cancelled on purpose)."""

    status: int | None = None
    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int | None = None
    error: str = ""  # message of a JSON error body or an SSE error event
    transport: str = ""  # the exception when the connection failed
    malformed: str = ""  # why the answer could not be read
    saw_done: bool = False
    hung: bool = False
    cancelled: bool = False  # by the client, as planned
    latency_s: float = 0.0


def request_id(planned: Planned) -> str:
    """Sent as X-Request-Id, so the children's logs name the request by its soak index."""
    return f"soak-{planned.index}" if planned.index >= 0 else f"soak-{planned.reference_key}"


def body_of(planned: Planned, model: str) -> dict:
    body = {"model": model, **planned.body, "stream": planned.stream}
    if planned.stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def send(session: aiohttp.ClientSession, gateway_url: str, model: str, planned: Planned,
               bound_s: float) -> Outcome:
    """Sends `planned`; the outcome within bound_s, else one marked hung."""
    outcome = Outcome()
    started = time.monotonic()
    try:
        if planned.action == "disconnect":
            exchange = _disconnect_early(gateway_url, planned, body_of(planned, model), outcome)
        else:
            exchange = _exchange(session, gateway_url, planned, model, outcome)
        await asyncio.wait_for(exchange, bound_s)
    except asyncio.TimeoutError:
        outcome.hung = True
    except (aiohttp.ClientError, OSError) as exc:
        outcome.transport = f"{type(exc).__name__}: {exc}"
    outcome.latency_s = time.monotonic() - started
    return outcome


async def _exchange(session: aiohttp.ClientSession, gateway_url: str, planned: Planned, model: str,
                    outcome: Outcome) -> None:
    url = f"{gateway_url}/v1/{'chat/completions' if planned.endpoint == 'chat' else 'completions'}"
    headers = {"X-Request-Id": request_id(planned)}
    async with session.post(url, json=body_of(planned, model), headers=headers) as reply:
        outcome.status = reply.status
        if reply.status != 200:
            _read_error(await reply.read(), outcome)
        elif planned.stream:
            await _read_stream(reply, planned, outcome)
        else:
            _read_whole(await reply.read(), outcome)


def _read_error(raw: bytes, outcome: Outcome) -> None:
    try:
        outcome.error = json.loads(raw)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        outcome.malformed = f"error body is not an OpenAI error: {raw[:200]!r}"


def _read_whole(raw: bytes, outcome: Outcome) -> None:
    try:
        answer = json.loads(raw)
        choice = answer["choices"][0]
        outcome.text = choice["message"]["content"] if "message" in choice else choice["text"]
        outcome.finish_reason = choice["finish_reason"]
        outcome.completion_tokens = answer["usage"]["completion_tokens"]
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        outcome.malformed = f"{type(exc).__name__} {exc}: {raw[:200]!r}"


async def _read_stream(reply: aiohttp.ClientResponse, planned: Planned, outcome: Outcome) -> None:
    async for line in reply.content:
        if not line.strip():
            continue
        if not line.startswith(b"data: "):
            outcome.malformed = f"not an SSE data line: {line[:200]!r}"
            return
        if line.strip() == b"data: [DONE]":
            outcome.saw_done = True
            return
        try:
            _read_event(json.loads(line[6:]), outcome)
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            outcome.malformed = f"{type(exc).__name__} {exc}: {line[:200]!r}"
            return
        if planned.action == "cancel":
            outcome.cancelled = True
            reply.close()  # drops the connection mid-stream
            return


def _read_event(event: dict, outcome: Outcome) -> None:
    if "error" in event:
        outcome.error = event["error"]["message"] or "(empty message)"
        return
    if event.get("usage"):
        outcome.completion_tokens = event["usage"]["completion_tokens"]
    for choice in event["choices"]:
        outcome.text += choice["delta"].get("content", "") if "delta" in choice else choice["text"]
        outcome.finish_reason = choice["finish_reason"] or outcome.finish_reason


async def _disconnect_early(gateway_url: str, planned: Planned, body: dict, outcome: Outcome) -> None:
    """Writes the whole request on a raw socket and closes it at once, before any answer byte."""
    url = urlsplit(gateway_url)
    path = "/v1/chat/completions" if planned.endpoint == "chat" else "/v1/completions"
    data = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: {url.netloc}\r\nContent-Type: application/json\r\n"
            f"X-Request-Id: {request_id(planned)}\r\nContent-Length: {len(data)}\r\n\r\n").encode()
    _, writer = await asyncio.open_connection(url.hostname, url.port)
    writer.write(head + data)
    await writer.drain()
    await asyncio.sleep(0.01)  # the gateway has read it and called the router
    writer.close()
    outcome.cancelled = True
