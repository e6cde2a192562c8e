"""Writing one router answer to the HTTP client: as one JSON object, or as SSE chunks while tokens arrive.

Streaming waits for the router's first message before sending headers, so
everything the router rejects up front (bad field, no workers, out of KV
capacity) is still a plain HTTP error with its status. After that, an error is
sent in-band as `data: {"error": ...}` followed by `data: [DONE]`.

Router messages carry a completion `index` (n > 1); each index is one OpenAI choice.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiohttp import web

from distserve.v1 import common_pb2, router_pb2
from services.router.gateway import responses, sse
from services.router.gateway.errors import ApiError, internal_error
from services.router.gateway.logprobs_format import CompletionLogprobs, chat_content, merge_completion_parts
from services.router.gateway.openai_protocol import Endpoint
from services.router.gateway.responses import AnswerMeta
from services.router.gateway.router_client import RouterAnswer

log = logging.getLogger(__name__)


class Choice:
    """One completion's state across the router's messages: text, logprobs, finish."""

    def __init__(self, meta: AnswerMeta, index: int):
        self.meta, self.index = meta, index
        self.parts: list[str] = []
        self.token_ids: list[int] = []
        self.logprob_parts: list[Any] = []
        self.finish: str | None = None
        self.started = False
        self._legacy = CompletionLogprobs(meta.token_text) if meta.logprobs and meta.token_text else None
        self.output = meta.chat_output() if meta.chat_output is not None else None  # reasoning and tool calls

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's finish_reason: "tool_calls" when the choice stopped after calling tools."""
        if self.output is None or self.finish is None:
            return self.finish
        return self.output.finish_reason(self.finish)

    def stream_delta(self, text: str) -> dict[str, Any] | None:
        """Chat with reasoning or tool parsing: the chunk's delta for this text (None: {"content": text})."""
        if self.output is None:
            return None
        delta = self.output.feed(text)
        if self.finish is not None:
            delta += self.output.finish()
        return delta.to_json()

    def whole_message(self) -> dict[str, Any] | None:
        """Chat with reasoning or tool parsing: the whole answer's message (None: the plain one)."""
        return self.output.message("".join(self.parts)) if self.output is not None else None

    def add(self, message: router_pb2.GenerateResponse, prompt: router_pb2.GenerateResponse) -> tuple[str, Any]:
        """The text and logprobs this message adds (the prompt leads a first message when echoing)."""
        text, logprobs = message.text, None
        if not self.started and self.meta.echo:
            text = prompt.prompt_text + text
        if self.meta.logprobs and self.meta.token_text:
            if self.meta.endpoint == Endpoint.CHAT:
                logprobs = {"content": chat_content(message.logprobs, self.meta.token_text)}
            else:
                echoed = self._legacy_prompt_part(prompt) if not self.started and self.meta.echo else None
                logprobs = self._legacy.part(message.logprobs)
                if echoed is not None:
                    logprobs = merge_completion_parts([echoed, logprobs])
            self.logprob_parts.append(logprobs)
        self.started = True
        self.parts.append(text)
        self.token_ids += message.token_ids
        if message.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
            self.finish = responses.finish_reason(message.finish_reason)
        return text, logprobs

    def _legacy_prompt_part(self, prompt: router_pb2.GenerateResponse) -> dict[str, Any]:
        # the prompt's offsets start at 0: a fresh accumulator, then completion offsets continue after it
        prompt_acc = CompletionLogprobs(self.meta.token_text)
        part = prompt_acc.prompt_part(list(prompt.prompt_token_ids), prompt.prompt_logprobs)
        self._legacy = CompletionLogprobs(self.meta.token_text, start_offset=len(prompt.prompt_text))
        return part

    def whole_logprobs(self) -> Any:
        if not self.logprob_parts:
            return None
        if self.meta.endpoint == Endpoint.CHAT:
            return {"content": [item for part in self.logprob_parts for item in part["content"]]}
        return merge_completion_parts(self.logprob_parts)


class Answer:
    """Every choice of one answer, fed the router's messages in order."""

    def __init__(self, meta: AnswerMeta):
        self.meta = meta
        self.choices = {i: Choice(meta, i) for i in range(meta.n)}
        self.prompt: router_pb2.GenerateResponse | None = None  # the first message: prompt extras
        self.usage = common_pb2.Usage()

    def add(self, message: router_pb2.GenerateResponse) -> tuple[Choice, str, Any]:
        if self.prompt is None:
            self.prompt = message
        choice = self.choices.get(message.index)
        if choice is None:
            raise internal_error(f"the router sent completion index {message.index} of {self.meta.n}")
        text, logprobs = choice.add(message, self.prompt)
        if message.HasField("usage"):
            self.usage.prompt_tokens = message.usage.prompt_tokens
            self.usage.cached_tokens = message.usage.cached_tokens
            self.usage.completion_tokens += message.usage.completion_tokens
        return choice, text, logprobs

    @property
    def done(self) -> bool:
        return all(c.finish is not None for c in self.choices.values())

    def extras(self) -> dict[str, Any]:
        """vLLM's prompt_logprobs, when asked for: null for the first prompt token, then {id: {...}}."""
        if self.prompt is None or not self.prompt.prompt_logprobs or self.meta.token_text is None:
            return {}
        entries = [None] + [{str(e.token_id): {"logprob": e.logprob, "rank": e.rank,
                                                "decoded_token": self.meta.token_text(e.token_id)}}
                            for e in self.prompt.prompt_logprobs]
        return {"prompt_logprobs": entries}


def _token_ids(meta: AnswerMeta, token_ids) -> dict[str, Any]:
    """{"token_ids": [...]} when the client asked for them (return_token_ids), else nothing."""
    return {"token_ids": list(token_ids)} if meta.return_token_ids and token_ids else {}


async def whole_answer(meta: AnswerMeta, router_answer: RouterAnswer) -> web.Response:
    """Reads the answer to the end; returns the OpenAI completion object."""
    answer = Answer(meta)
    while (message := await router_answer.next()) is not None:
        answer.add(message)
    extras = answer.extras()
    choices = []
    for c in answer.choices.values():
        message = c.whole_message()  # first: it parses the text, which finish_reason reads
        choices.append(responses.whole_choice(meta, c.index, "".join(c.parts), c.finish_reason, c.whole_logprobs(),
                                              {**extras, **_token_ids(meta, c.token_ids)}, message))
    return web.json_response(responses.full_response(meta, choices, answer.usage), dumps=sse.json_text)


async def streamed_answer(http_request: web.Request, meta: AnswerMeta, router_answer: RouterAnswer,
                          headers: dict[str, str]) -> web.StreamResponse:
    """Streams SSE chunks as router messages arrive; stops quietly when the client goes away."""
    first = await router_answer.next()  # errors up to here are plain HTTP errors
    response = web.StreamResponse(headers={**sse.HEADERS, **headers})
    await response.prepare(http_request)
    try:
        try:
            await _write_chunks(response, meta, router_answer, first)
        except ApiError as exc:
            log.warning("stream failed request_id=%s: %s", meta.id, exc)
            await response.write(sse.event(exc.body()))
        except ConnectionError:
            raise
        except Exception:  # a bug: the client still gets an error event and [DONE]
            log.exception("stream failed request_id=%s", meta.id)
            await response.write(sse.event(internal_error().body()))
        await response.write(sse.DONE)
        await response.write_eof()
    except ConnectionError:  # the client went away; the caller cancels the router call
        log.info("client disconnected request_id=%s", meta.id)
    except asyncio.CancelledError:  # aiohttp noticed first (handler cancellation), or the gateway is stopping
        log.info("stream cancelled request_id=%s", meta.id)
        raise
    return response


async def _write_chunks(response: web.StreamResponse, meta: AnswerMeta, router_answer: RouterAnswer,
                        message) -> None:
    answer = Answer(meta)
    if meta.endpoint == Endpoint.CHAT:
        for index in range(meta.n):
            await response.write(sse.event(responses.role_chunk(meta, index)))
    while message is not None:
        is_first = answer.prompt is None
        choice, text, logprobs = answer.add(message)
        # the router may hold text back (stop strings, partial UTF-8): empty chunks only when they say more
        token_ids = _token_ids(meta, message.token_ids)
        delta = choice.stream_delta(text)
        if (text if delta is None else delta) or choice.finish is not None or logprobs is not None or token_ids:
            extras = {**(answer.extras() if is_first else {}), **token_ids}
            await response.write(sse.event(responses.text_chunk(meta, text, choice.finish_reason, choice.index,
                                                                logprobs, extras, delta)))
        if answer.done:
            break
        message = await router_answer.next()
    if meta.include_usage:
        await response.write(sse.event(responses.usage_chunk(meta, answer.usage)))
