"""Reasoning apart from the answer: `<think>...</think>` text becomes `reasoning_content`.

Two models of where thinking starts (the gateway's --reasoning-parser, vLLM's names):
- deepseek_r1: the chat template already opened `<think>` in the prompt, so the output is reasoning
  from its first token until `</think>` (a leading `<think>` the model writes anyway is dropped).
  Output with no `</think>` is all reasoning, and the content is empty.
- qwen3: only output that starts with `<think>` reasons; other output is all content (a template
  with thinking turned off, `enable_thinking: false`).

Streaming: a piece that ends in a possible half of a tag is held back until the next piece decides.
"""

from __future__ import annotations

from services.router.gateway.tool_parsers import partial_marker_at_end

OPEN, CLOSE = "<think>", "</think>"
PARSERS = ("deepseek_r1", "qwen3")


class ReasoningParser:
    """One choice's output, fed in pieces; each `feed` returns (reasoning, content) text."""

    def __init__(self, kind: str) -> None:
        if kind not in PARSERS:
            raise ValueError(f"reasoning parser must be one of {', '.join(PARSERS)}, got {kind!r}")
        self._starts_thinking = kind == "deepseek_r1"
        self._state = "start"  # start -> reasoning -> content
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        self._held += text
        if self._state == "start":
            self._decide_start()
        reasoning = content = ""
        if self._state == "reasoning":
            reasoning = self._reasoning()
        if self._state == "content":
            content, self._held = self._held, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """The output ended: what was held back."""
        held, self._held = self._held, ""
        if self._state == "reasoning" or (self._state == "start" and self._starts_thinking):
            return held, ""
        return "", held

    def _decide_start(self) -> None:
        stripped = self._held.lstrip()
        if stripped.startswith(OPEN):
            self._held, self._state = stripped[len(OPEN):], "reasoning"
        elif not stripped or OPEN.startswith(stripped):
            return  # maybe the opening tag, half written
        else:
            self._state = "reasoning" if self._starts_thinking else "content"

    def _reasoning(self) -> str:
        end = self._held.find(CLOSE)
        if end >= 0:
            reasoning, content = self._held[:end], self._held[end + len(CLOSE):]
            self._held, self._state = content, "content"
            return reasoning
        keep = partial_marker_at_end(self._held, CLOSE)
        reasoning, self._held = self._held[:len(self._held) - keep], self._held[len(self._held) - keep:]
        return reasoning
