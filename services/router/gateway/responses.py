"""OpenAI response objects built from router messages: whole answers and streaming chunks.

Completions: object `text_completion`, choice `text`. Chat: `chat.completion`
with choice `message`, or `chat.completion.chunk` with choice `delta` (the first
chunk carries role "assistant"). Every chunk of one answer has the same `id` and
`created`; `finish_reason` is null until the last choice chunk.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from distserve.v1 import common_pb2
from services.router.gateway.errors import ApiError, internal_error
from services.router.gateway.openai_protocol import Endpoint

_FINISH = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length"}
ID_PREFIX = {Endpoint.COMPLETIONS: "cmpl-", Endpoint.CHAT: "chatcmpl-"}


@dataclasses.dataclass(frozen=True)
class AnswerMeta:
    """What every object of one answer repeats."""

    id: str
    created: int  # unix seconds
    model: str
    endpoint: Endpoint
    include_usage: bool = False  # streaming: `usage: null` on choice chunks, one usage chunk at the end


def finish_reason(value: int) -> str:
    """Router FinishReason -> "stop" | "length". CANCELLED means the router gave up on the request."""
    if value == common_pb2.FINISH_REASON_CANCELLED:
        raise ApiError(503, "the request was cancelled by the server", type="server_error",
                       code="service_unavailable")
    if value not in _FINISH:
        raise internal_error(f"unexpected finish reason {value} from the router")
    return _FINISH[value]


def usage(value: common_pb2.Usage) -> dict[str, int]:
    return {"prompt_tokens": value.prompt_tokens, "completion_tokens": value.completion_tokens,
            "total_tokens": value.prompt_tokens + value.completion_tokens}


def full_response(meta: AnswerMeta, text: str, finish: str, counts: common_pb2.Usage) -> dict[str, Any]:
    """The non-streaming answer."""
    if meta.endpoint == Endpoint.CHAT:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish}
        kind = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        kind = "text_completion"
    return {**_head(meta, kind), "choices": [choice], "usage": usage(counts)}


def role_chunk(meta: AnswerMeta) -> dict[str, Any]:
    """Chat streaming starts with the assistant's role and no text yet."""
    return _chunk(meta, {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None})


def text_chunk(meta: AnswerMeta, text: str, finish: str | None) -> dict[str, Any]:
    if meta.endpoint == Endpoint.CHAT:
        choice = {"index": 0, "delta": {"content": text} if text else {}, "logprobs": None, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    return _chunk(meta, choice)


def usage_chunk(meta: AnswerMeta, counts: common_pb2.Usage) -> dict[str, Any]:
    """The one chunk sent right before [DONE] when stream_options.include_usage is set."""
    return {**_head(meta, _chunk_object(meta)), "choices": [], "usage": usage(counts)}


def _chunk(meta: AnswerMeta, choice: dict[str, Any]) -> dict[str, Any]:
    chunk = {**_head(meta, _chunk_object(meta)), "choices": [choice]}
    if meta.include_usage:
        chunk["usage"] = None
    return chunk


def _chunk_object(meta: AnswerMeta) -> str:
    return "chat.completion.chunk" if meta.endpoint == Endpoint.CHAT else "text_completion"


def _head(meta: AnswerMeta, kind: str) -> dict[str, Any]:
    return {"id": meta.id, "object": kind, "created": meta.created, "model": meta.model,
            "system_fingerprint": None}
