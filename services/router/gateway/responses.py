"""OpenAI response objects built from router messages: whole answers and streaming chunks.

Completions: object `text_completion`, choice `text`. Chat: `chat.completion`
with choice `message`, or `chat.completion.chunk` with choice `delta` (the first
chunk carries role "assistant"). Every chunk of one answer has the same `id` and
`created`; `finish_reason` is null until a choice's last chunk. With n > 1 each
choice has its own `index`; the usage counts every completion.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from distserve.v1 import common_pb2
from services.router.gateway.chat_output import ChatOutputFactory
from services.router.gateway.errors import ApiError, internal_error
from services.router.gateway.logprobs_format import TokenText
from services.router.gateway.openai_protocol import Endpoint

_FINISH = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length"}
ID_PREFIX = {Endpoint.COMPLETIONS: "cmpl-", Endpoint.CHAT: "chatcmpl-"}


@dataclasses.dataclass(frozen=True)
class AnswerMeta:
    """What every object of one answer repeats, and how its choices are shaped."""

    id: str
    created: int  # unix seconds
    model: str
    endpoint: Endpoint
    include_usage: bool = False  # streaming: `usage: null` on choice chunks, one usage chunk at the end
    n: int = 1  # choices
    logprobs: bool = False  # choices carry logprobs
    echo: bool = False  # completions: the prompt leads the text (and the logprobs)
    token_text: TokenText | None = None  # token id -> its string, for logprobs
    return_token_ids: bool = False  # completions: each choice (chunk) carries `token_ids` too, as vLLM's do
    chat_output: ChatOutputFactory | None = None  # chat: each choice's reasoning and tool-call parsers


def finish_reason(value: int) -> str:
    """Router FinishReason -> "stop" | "length". CANCELLED means the router gave up on the request."""
    if value == common_pb2.FINISH_REASON_CANCELLED:
        raise ApiError(503, "the request was cancelled by the server", type="server_error",
                       code="service_unavailable")
    if value not in _FINISH:
        raise internal_error(f"unexpected finish reason {value} from the router")
    return _FINISH[value]


def usage(value: common_pb2.Usage) -> dict[str, Any]:
    """OpenAI's usage object; prompt_tokens_details.cached_tokens: prompt tokens a prefix cache supplied."""
    return {"prompt_tokens": value.prompt_tokens, "completion_tokens": value.completion_tokens,
            "total_tokens": value.prompt_tokens + value.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": value.cached_tokens}}


def whole_choice(meta: AnswerMeta, index: int, text: str, finish: str, logprobs: Any = None,
                 extras: dict[str, Any] | None = None, message: dict[str, Any] | None = None) -> dict[str, Any]:
    """One choice of the non-streaming answer (extras: e.g. vLLM's prompt_logprobs; message: a chat
    message with reasoning or tool calls, instead of the plain one)."""
    if meta.endpoint == Endpoint.CHAT:
        choice = {"index": index, "message": message or {"role": "assistant", "content": text},
                  "logprobs": logprobs, "finish_reason": finish}
    else:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
    return {**choice, **(extras or {})}


def full_response(meta: AnswerMeta, choices: list[dict[str, Any]], counts: common_pb2.Usage) -> dict[str, Any]:
    """The non-streaming answer."""
    kind = "chat.completion" if meta.endpoint == Endpoint.CHAT else "text_completion"
    return {**_head(meta, kind), "choices": choices, "usage": usage(counts)}


def role_chunk(meta: AnswerMeta, index: int = 0) -> dict[str, Any]:
    """Chat streaming starts each choice with the assistant's role and no text yet."""
    return _chunk(meta, {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None})


def text_chunk(meta: AnswerMeta, text: str, finish: str | None, index: int = 0, logprobs: Any = None,
               extras: dict[str, Any] | None = None, delta: dict[str, Any] | None = None) -> dict[str, Any]:
    """One streamed chunk of one choice; a chat `delta` (reasoning, tool calls) replaces {"content": text}."""
    if meta.endpoint == Endpoint.CHAT:
        if delta is None:
            delta = {"content": text} if text else {}
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
    else:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
    return _chunk(meta, {**choice, **(extras or {})})


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
