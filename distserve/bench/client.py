"""The HTTP driver: sends each request at its arrival time as a streaming /v1/completions call and times it.

One aiohttp session serves a whole run. Before any load, `check_endpoint` asks
GET /v1/models, so an unreachable server or a wrong model name fails with one
clear line (`EndpointError`) instead of a run full of failed requests.

A request's life: sleep until its arrival offset -> POST (TTFT and E2E are timed
from here) -> SSE chunks: the first carrying text (or token ids) stamps TTFT,
`usage` gives the output token count -> `data: [DONE]` stamps E2E. Anything
else (an HTTP error status, an in-band `{"error": ...}` event, a stream cut
before [DONE], a connection error) makes the request failed, with its reason.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import aiohttp
from tqdm import tqdm

from distserve.bench.stats import RequestRecord

PROBE_TIMEOUT_S = 10.0
# No byte for this long fails the request; no total limit: under overload a request may queue for minutes.
READ_TIMEOUT_S = 300.0


class EndpointError(Exception):
    """The endpoint cannot be benchmarked (unreachable, refuses, or does not serve the model); one line."""


@dataclasses.dataclass(frozen=True)
class Endpoint:
    url: str  # base URL, without /v1
    model: str
    api_key: str = ""

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclasses.dataclass(frozen=True)
class BenchRequest:
    prompt: list[int]
    output_len: int


def open_session() -> aiohttp.ClientSession:
    # limit=0: no client-side connection cap, or requests past 100 in flight would queue here and inflate TTFT.
    connector = aiohttp.TCPConnector(limit=0)
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None,
                                                                                    sock_read=READ_TIMEOUT_S))


async def list_models(session: aiohttp.ClientSession, url: str, api_key: str = "") -> list[dict[str, Any]]:
    """The model cards of GET {url}/v1/models. Raises EndpointError when it cannot be read."""
    headers = Endpoint(url, "", api_key).headers()
    try:
        async with session.get(f"{url}/v1/models", headers=headers,
                               timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)) as response:
            body = await response.text()
            if response.status != 200:
                raise EndpointError(f"{url}/v1/models answered HTTP {response.status}: {body[:300]}")
    except aiohttp.ClientConnectorError as exc:
        reason = _os_reason(exc.os_error) or str(exc)
        raise EndpointError(f"cannot reach {url}: {reason}") from exc
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        raise EndpointError(f"cannot reach {url}: {type(exc).__name__} {exc}".rstrip()) from exc
    try:
        cards = json.loads(body)["data"]
        return [card for card in cards if isinstance(card, dict) and "id" in card]
    except (ValueError, KeyError, TypeError) as exc:
        raise EndpointError(f"{url}/v1/models did not answer an OpenAI model list: {body[:300]}") from exc


def _os_reason(error: OSError | None) -> str:
    """'Connection refused' rather than asyncio's "Connect call failed ('127.0.0.1', 1)"."""
    if error is None:
        return ""
    return os.strerror(error.errno) if error.errno and error.errno > 0 else (error.strerror or "")


def pick_model(url: str, cards: list[dict[str, Any]], model: str | None) -> dict[str, Any]:
    """The card of `model`, or of the first served model when None. Raises EndpointError when not served."""
    served = [card["id"] for card in cards]
    if model is None:
        if not cards:
            raise EndpointError(f"{url} serves no model")
        return cards[0]
    if model not in served:
        raise EndpointError(f"model {model!r} is not served at {url}; served: {served}")
    return cards[served.index(model)]


def request_body(endpoint: Endpoint, request: BenchRequest, return_token_ids: bool = False) -> dict[str, Any]:
    # ignore_eos and min_tokens pin the output length, so every system decodes the same number of tokens.
    body = {"model": endpoint.model, "prompt": request.prompt, "max_tokens": request.output_len,
            "min_tokens": request.output_len, "ignore_eos": True, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if return_token_ids:
        body["return_token_ids"] = True  # vLLM's extra (distserve's too): each chunk carries its token ids
    return body


class _Stream:
    """What one SSE stream has shown so far."""

    def __init__(self, answer_ids: list[int] | None = None) -> None:
        self.answer_ids = answer_ids  # extended with each chunk's token_ids, when given
        self.first_content_s: float | None = None
        self.num_chunks = 0  # chunks carrying output
        self.token_gaps_s: list[float] = []  # per token after the first chunk: its chunk's gap (stats.py: ITL)
        self._last_content_s: float | None = None
        self.usage_tokens: int | None = None
        self.error = ""
        self.done = False

    def feed(self, line: bytes, now: float) -> None:
        text = line.decode("utf-8").strip()
        if not text.startswith("data:"):
            return  # blank separators, comments, event: lines
        payload = text[len("data:"):].strip()
        if payload == "[DONE]":
            self.done = True
            return
        event = json.loads(payload)
        if "error" in event:
            error = event["error"]
            self.error = str(error.get("message", error) if isinstance(error, dict) else error)
            return
        for choice in event.get("choices") or []:
            if self.answer_ids is not None:
                self.answer_ids.extend(choice.get("token_ids") or [])
            if choice.get("text") or choice.get("token_ids"):
                self.num_chunks += 1
                if self.first_content_s is None:
                    self.first_content_s = now
                else:  # a chunk's token count is known when it carries token ids; else one token a chunk
                    self.token_gaps_s += [now - self._last_content_s] * max(len(choice.get("token_ids") or ()), 1)
                self._last_content_s = now
        usage = event.get("usage")
        if usage and usage.get("completion_tokens") is not None:
            self.usage_tokens = int(usage["completion_tokens"])


async def send_one(session: aiohttp.ClientSession, endpoint: Endpoint, request: BenchRequest,
                   arrival_s: float, answer_ids: list[int] | None = None) -> RequestRecord:
    """POSTs one streaming completion and reads it to the end; never raises for the server's faults.
    With `answer_ids`, asks for the answer's token ids (return_token_ids) and appends them there."""
    stream, error = _Stream(answer_ids), ""
    start = time.perf_counter()
    body = request_body(endpoint, request, return_token_ids=answer_ids is not None)
    try:
        async with session.post(f"{endpoint.url}/v1/completions", json=body,
                                headers=endpoint.headers()) as response:
            if response.status != 200:
                error = f"HTTP {response.status}: {_error_message(await response.text())}"
            else:
                async for line in response.content:
                    stream.feed(line, time.perf_counter())
                    if stream.done or stream.error:
                        break
                error = stream.error or ("" if stream.done else "stream ended before [DONE]")
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:  # ValueError: bad JSON or UTF-8
        error = f"{type(exc).__name__}: {exc}".rstrip(": ")
    end = time.perf_counter()
    tokens = stream.usage_tokens if stream.usage_tokens is not None else stream.num_chunks
    ttft = None if stream.first_content_s is None else stream.first_content_s - start
    return RequestRecord(arrival_s=arrival_s, input_len=len(request.prompt), output_len=tokens, ttft_s=ttft,
                         e2e_s=None if error else end - start, ok=not error, error=error,
                         token_gaps_s=tuple(stream.token_gaps_s))


def _error_message(body: str) -> str:
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body[:300]


async def run_rate(session: aiohttp.ClientSession, endpoint: Endpoint, requests: Sequence[BenchRequest],
                   arrivals: Sequence[float], desc: str = "") -> tuple[list[RequestRecord], float]:
    """Sends request i at arrivals[i] seconds from now; waits for all. Returns (records in order, duration_s).

    duration_s runs from the start to the last request's end.
    """
    progress = tqdm(total=len(requests), desc=desc, unit="req", file=sys.stderr, disable=None, leave=False)
    start = time.perf_counter()

    async def timed(request: BenchRequest, arrival_s: float) -> RequestRecord:
        await asyncio.sleep(max(0.0, start + arrival_s - time.perf_counter()))
        record = await send_one(session, endpoint, request, arrival_s)
        progress.update(1)
        return record

    try:
        records = await asyncio.gather(*(timed(r, a) for r, a in zip(requests, arrivals)))
    finally:
        progress.close()
    return list(records), time.perf_counter() - start
