"""One chat choice's text split into what OpenAI's message has apart: reasoning, content, tool calls.

`ChatOutput` runs the reasoning parser first (when the gateway has one), then the tool-call parser over
the content that is left (when the request has tools). The parser's state machines live here, in the
gateway, not in the router: they shape OpenAI's JSON and nothing else, each choice of each request has
its own, and the router's text stream (also across a migration, which re-prefills and continues the
same text) is all they need.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from services.router.gateway.reasoning import ReasoningParser
from services.router.gateway.tool_parsers import Parsed, ToolCallParser


@dataclasses.dataclass
class ChatDelta:
    """What one piece of text adds to a choice."""

    content: str = ""
    reasoning: str = ""
    calls: list = dataclasses.field(default_factory=list)  # tool_parsers.CallDelta

    def __add__(self, other: ChatDelta) -> ChatDelta:
        return ChatDelta(self.content + other.content, self.reasoning + other.reasoning, self.calls + other.calls)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.calls)

    def to_json(self) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        if self.reasoning:
            delta["reasoning_content"] = self.reasoning
        if self.content:
            delta["content"] = self.content
        if self.calls:
            delta["tool_calls"] = [call.to_json() for call in self.calls]
        return delta


class ChatOutput:
    """One choice's parsers, fed its text in the router's pieces."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolCallParser | None):
        self._reasoning, self._tools = reasoning, tools
        self._raw_content: list[str] = []  # the content before tool parsing, for an answer cut mid-call

    def feed(self, text: str) -> ChatDelta:
        reasoning, content = self._reasoning.feed(text) if self._reasoning else ("", text)
        return self._with_calls(reasoning, content, end=False)

    def finish(self) -> ChatDelta:
        """The choice's text ended: what the parsers held back."""
        reasoning, content = self._reasoning.finish() if self._reasoning else ("", "")
        return self._with_calls(reasoning, content, end=True)

    def finish_reason(self, finish: str) -> str:
        """OpenAI's: "tool_calls" when the choice stopped after calling tools."""
        return "tool_calls" if finish == "stop" and self._tools is not None and self._tools.has_calls else finish

    def message(self, text: str) -> dict[str, Any]:
        """The whole choice's message (text: all of it, fed through a fresh ChatOutput)."""
        whole = self.feed(text)
        rest = self.finish()
        reasoning, content = whole.reasoning + rest.reasoning, whole.content + rest.content
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if self._reasoning is not None:
            message["reasoning_content"] = reasoning or None
        calls = self._tools.calls() if self._tools is not None else None
        if calls is None and self._tools is not None and self._tools.has_calls:
            message["content"] = "".join(self._raw_content)  # a call cut off: the text as it came, as vLLM
        elif calls:
            message["tool_calls"] = [call.to_json() for call in calls]
            message["content"] = content or None
        return message

    def _with_calls(self, reasoning: str, content: str, end: bool) -> ChatDelta:
        if self._tools is None:
            return ChatDelta(content, reasoning)
        self._raw_content.append(content)
        parsed = self._tools.feed(content) if content else Parsed()
        if end:
            parsed += self._tools.finish()
        return ChatDelta(parsed.content, reasoning, parsed.calls)


ChatOutputFactory = Callable[[], ChatOutput]
