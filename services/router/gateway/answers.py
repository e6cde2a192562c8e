"""Writing one router answer to the HTTP client: as one JSON object, or as SSE chunks while tokens arrive.

Streaming waits for the router's first message before sending headers, so
everything the router rejects up front (bad field, no workers, out of KV
capacity) is still a plain HTTP error with its status. After that, an error is
sent in-band as `data: {"error": ...}` followed by `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from distserve.v1 import common_pb2
from services.router.gateway import responses, sse
from services.router.gateway.errors import ApiError, internal_error
from services.router.gateway.openai_protocol import Endpoint
from services.router.gateway.responses import AnswerMeta
from services.router.gateway.router_client import RouterAnswer

log = logging.getLogger(__name__)


async def whole_answer(meta: AnswerMeta, answer: RouterAnswer) -> web.Response:
    """Reads the answer to the end; returns the OpenAI completion object."""
    parts, last = [], None
    while (message := await answer.next()) is not None:
        parts.append(message.text)
        last = message
    finish = responses.finish_reason(last.finish_reason)
    return web.json_response(responses.full_response(meta, "".join(parts), finish, last.usage))


async def streamed_answer(http_request: web.Request, meta: AnswerMeta, answer: RouterAnswer,
                          headers: dict[str, str]) -> web.StreamResponse:
    """Streams SSE chunks as router messages arrive; stops quietly when the client goes away."""
    first = await answer.next()  # errors up to here are plain HTTP errors
    response = web.StreamResponse(headers={**sse.HEADERS, **headers})
    await response.prepare(http_request)
    try:
        try:
            await _write_chunks(response, meta, answer, first)
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


async def _write_chunks(response: web.StreamResponse, meta: AnswerMeta, answer: RouterAnswer, message) -> None:
    if meta.endpoint == Endpoint.CHAT:
        await response.write(sse.event(responses.role_chunk(meta)))
    while True:
        is_last = message.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
        finish = responses.finish_reason(message.finish_reason) if is_last else None
        if message.text or is_last:  # the router may hold text back (stop strings, partial UTF-8)
            await response.write(sse.event(responses.text_chunk(meta, message.text, finish)))
        if is_last:
            break
        message = await answer.next()
    if meta.include_usage:
        await response.write(sse.event(responses.usage_chunk(meta, message.usage)))
