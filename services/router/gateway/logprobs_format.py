"""Router TokenLogprobs -> OpenAI's two logprobs shapes.

Completions (legacy): {"tokens": [str], "token_logprobs": [float|null], "top_logprobs": [{str: float}|null],
"text_offset": [int]}; with echo, the prompt's positions come first and the first prompt token has null
entries (nothing predicts it). Chat: {"content": [{"token", "logprob", "bytes", "top_logprobs":
[{"token", "logprob", "bytes"}]}]}. A token's string is its own decoding (a byte-level token that is part
of a multi-byte character decodes to U+FFFD, as in vLLM); `bytes` are that string's UTF-8 bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from distserve.v1 import common_pb2

TokenText = Callable[[int], str]
# A token the sampler could not pick (a grammar or top-k mask) has logprob -inf, which JSON cannot spell;
# as in vLLM, the answer says -9999.0.
LOWEST_LOGPROB = -9999.0


def _finite(logprob: float) -> float:
    return logprob if logprob > LOWEST_LOGPROB else LOWEST_LOGPROB


class CompletionLogprobs:
    """Accumulates one completion's legacy logprobs object across streamed chunks (text_offset runs on)."""

    def __init__(self, token_text: TokenText, start_offset: int = 0):
        self._token_text = token_text
        self._offset = start_offset

    def prompt_part(self, prompt_ids: Sequence[int], entries: Sequence[common_pb2.TokenLogprobs]) -> dict[str, Any]:
        """The echoed prompt's positions: the first token has no logprob; the rest take `entries`."""
        part = self._empty()
        if not prompt_ids:
            return part
        self._add(part, prompt_ids[0], None)
        for token, entry in zip(prompt_ids[1:], entries):
            self._add(part, token, entry)
        return part

    def part(self, entries: Sequence[common_pb2.TokenLogprobs]) -> dict[str, Any]:
        part = self._empty()
        for entry in entries:
            self._add(part, entry.token_id, entry)
        return part

    def _add(self, part: dict[str, Any], token: int, entry: common_pb2.TokenLogprobs | None) -> None:
        text = self._token_text(token)
        part["tokens"].append(text)
        part["token_logprobs"].append(None if entry is None else _finite(entry.logprob))
        part["top_logprobs"].append(None if entry is None else self._top(entry, text))
        part["text_offset"].append(self._offset)
        self._offset += len(text)

    def _top(self, entry: common_pb2.TokenLogprobs, text: str) -> dict[str, float]:
        top = {self._token_text(t): _finite(lp) for t, lp in zip(entry.top_token_ids, entry.top_logprobs)}
        top.setdefault(text, _finite(entry.logprob))  # OpenAI includes the chosen token
        return top

    @staticmethod
    def _empty() -> dict[str, Any]:
        return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}


def merge_completion_parts(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    merged = CompletionLogprobs._empty()
    for part in parts:
        for key in merged:
            merged[key] += part[key]
    return merged


def chat_content(entries: Sequence[common_pb2.TokenLogprobs], token_text: TokenText) -> list[dict[str, Any]]:
    """Chat's `logprobs.content` items for these tokens."""
    return [{**_chat_token(entry.token_id, entry.logprob, token_text),
             "top_logprobs": [_chat_token(t, lp, token_text) for t, lp in zip(entry.top_token_ids, entry.top_logprobs)]}
            for entry in entries]


def _chat_token(token: int, logprob: float, token_text: TokenText) -> dict[str, Any]:
    text = token_text(token)
    return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}
