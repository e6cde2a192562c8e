"""Tool calls out of model text, as it streams: the formats the common model families write.

A parser is fed one choice's text in the pieces the router sends and returns, per piece, the plain
content and the tool-call deltas it can already tell apart (`Parsed`). Text that might still turn
into a call's opening (a half-written `<tool_call>`) is held back until the next piece decides it.

Formats (`PARSERS`, chosen with the gateway's --tool-call-parser, or by the chat template):
- hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number, with content
  around them (Hermes, Qwen2.5, and this project's default models);
- llama3_json: the answer starts with `{"name": ..., "parameters": {...}}`; several are joined by
  `;` (Llama 3.1-3.3; its `<|python_tag|>` is a special token, dropped from the text before this);
- mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`. `[TOOL_CALLS]` is a special token
  in Mistral's tokenizers, so the router's text usually lacks it; an answer that starts with `[{`
  is read as calls too. Mistral's newer `[TOOL_CALLS]name[ARGS]{...}` form is not parsed.

Two more read output that a grammar forced (tool_choice "required" or a named function): `ArrayOfCalls`
for `[{"name": ..., "arguments": ...}, ...]`, and `NamedCall`, where the whole text is the arguments.
"""

from __future__ import annotations

import dataclasses
import json
import uuid

from services.router.gateway.call_scanner import CallScanner

_WHITESPACE = " \t\r\n"


@dataclasses.dataclass
class CallDelta:
    """One piece of one call, in OpenAI's streaming shape: the first piece of a call carries its id and
    name, the later ones argument text only."""

    index: int  # which call of the choice, from 0
    arguments: str
    id: str | None = None
    name: str | None = None

    def to_json(self) -> dict:
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclasses.dataclass
class Parsed:
    content: str = ""
    calls: list[CallDelta] = dataclasses.field(default_factory=list)

    def __add__(self, other: Parsed) -> Parsed:
        return Parsed(self.content + other.content, self.calls + other.calls)


@dataclasses.dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text

    def to_json(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class ToolCallParser:
    """Base: the calls found so far, each a CallScanner, and the deltas they yield."""

    def __init__(self) -> None:
        self._scanners: list[CallScanner] = []
        self._ids: list[str] = []

    def feed(self, text: str) -> Parsed:
        raise NotImplementedError

    def finish(self) -> Parsed:
        """The output ended: whatever was held back, as content."""
        return Parsed()

    def calls(self) -> list[ToolCall] | None:
        """The calls, when every one that started also closed as a call; None when one was cut off or
        broke after its name was out (then the whole text is the answer's content, as vLLM returns it)."""
        if any(not s.done or s.broken for s in self._scanners):
            return None
        return [ToolCall(i, s.name, s.arguments_text()) for i, s in zip(self._ids, self._scanners)]

    @property
    def has_calls(self) -> bool:
        return any(s.name is not None for s in self._scanners)

    def _open_call(self) -> CallScanner:
        scanner = CallScanner()
        self._scanners.append(scanner)
        self._ids.append(new_call_id())
        return scanner

    def _drop_last_call(self) -> str:
        """The last call turned out not to be one before naming a function: its text, to be content."""
        self._ids.pop()
        return "".join(self._scanners.pop().raw)

    def _deltas(self) -> list[CallDelta]:
        deltas = []
        for index, (call_id, scanner) in enumerate(zip(self._ids, self._scanners)):
            name, arguments = scanner.take()
            if name is not None:
                deltas.append(CallDelta(index, arguments, call_id, name))
            elif arguments:
                deltas.append(CallDelta(index, arguments))
        return deltas


def partial_marker_at_end(text: str, marker: str) -> int:
    """How many characters at text's end could begin `marker` (held back until more text decides)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class MarkedCallsParser(ToolCallParser):
    """Base of the parsers that read calls out of running text: `_held` is the text not yet classified, and
    `_advance` classifies some of it, returning (whether it got anywhere, the content it let out)."""

    def __init__(self) -> None:
        super().__init__()
        self._held = ""

    def feed(self, text: str) -> Parsed:
        self._held += text
        out = Parsed()
        while self._held:
            progressed, piece = self._advance()
            out += piece
            if not progressed:
                break
        out.calls = self._deltas()
        return out

    def _advance(self) -> tuple[bool, Parsed]:
        raise NotImplementedError


class HermesParser(MarkedCallsParser):
    """`<tool_call>` JSON `</tool_call>`, repeated, with content anywhere around."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        super().__init__()
        self._in_call: CallScanner | None = None
        self._expect_close = False

    def finish(self) -> Parsed:
        held, self._held = self._held, ""
        if self._in_call is not None and self._in_call.name is None:
            held = self.OPEN + self._drop_last_call() + held  # never became a call
            self._in_call = None
        if self._expect_close or self._in_call is not None:
            return Parsed()
        return Parsed(self._content(held))

    def _advance(self) -> tuple[bool, Parsed]:
        if self._in_call is not None:
            return self._advance_call()
        if self._expect_close:
            return self._advance_close()
        start = self._held.find(self.OPEN)
        if start < 0:
            keep = partial_marker_at_end(self._held, self.OPEN)
            content, self._held = self._held[:len(self._held) - keep], self._held[len(self._held) - keep:]
            return False, Parsed(self._content(content))
        content, self._held = self._held[:start], self._held[start + len(self.OPEN):]
        content = self._content(content)  # before the call opens: whitespace before a first call is content
        self._in_call = self._open_call()
        return True, Parsed(content)

    def _advance_call(self) -> tuple[bool, Parsed]:
        scanner = self._in_call
        self._held = scanner.feed(self._held)
        if scanner.broken and scanner.name is None:
            self._held = self.OPEN + self._drop_last_call() + self._held
            self._in_call = None
            # not a call: its opening tag is content; look for the next tag after it
            content, self._held = self._held[:len(self.OPEN)], self._held[len(self.OPEN):]
            return True, Parsed(content)
        if scanner.done or scanner.broken:
            self._in_call, self._expect_close = None, True
            return True, Parsed()
        return False, Parsed()

    def _advance_close(self) -> tuple[bool, Parsed]:
        stripped = self._held.lstrip(_WHITESPACE)
        if not stripped:
            return False, Parsed()
        if stripped.startswith(self.CLOSE):
            self._held, self._expect_close = stripped[len(self.CLOSE):], False
            return True, Parsed()
        if self.CLOSE.startswith(stripped):
            return False, Parsed()  # half the closing tag so far
        self._expect_close = False  # no closing tag: tolerated, what follows is content again
        return True, Parsed()

    def _content(self, text: str) -> str:
        # between and after calls, whitespace alone is layout, not an answer
        return "" if self._scanners and not text.strip() else text


class JsonCallsParser(MarkedCallsParser):
    """Calls written as bare JSON objects at the start of the answer, with `separator` between them
    (`;` for llama3_json, `,` inside the brackets of an array). Content when the answer does not start
    with one (after `prefix`, when given, and whitespace)."""

    def __init__(self, opener: str = "{", separator: str = ";", closer: str = "", prefix: str = "") -> None:
        super().__init__()
        self._opener, self._separator, self._closer, self._prefix = opener, separator, closer, prefix
        self._state = "start"  # start -> calls (in_call / between) -> content
        self._in_call: CallScanner | None = None
        self._unclaimed = ""  # an opener bracket read before any call began

    def finish(self) -> Parsed:
        held, self._held = self._held, ""
        if self._state == "start" or self._state == "content":
            return Parsed(held)
        if not self._scanners:
            return Parsed(self._unclaimed + held)
        if self._in_call is not None and self._in_call.name is None:
            self._drop_last_call()
        return Parsed()

    def _advance(self) -> tuple[bool, Parsed]:
        if self._state == "content":
            content, self._held = self._held, ""
            return False, Parsed(content)
        if self._state == "start":
            return self._advance_start()
        if self._in_call is not None:
            return self._advance_call()
        return self._advance_between()

    def _advance_start(self) -> tuple[bool, Parsed]:
        text = self._held.lstrip(_WHITESPACE)
        if self._prefix and text.startswith(self._prefix):
            text = text[len(self._prefix):].lstrip(_WHITESPACE)
        elif self._prefix and self._prefix.startswith(text):
            return False, Parsed()
        if not text or (self._opener.startswith(text) and text != self._opener):
            return False, Parsed()
        if not text.startswith(self._opener):
            self._state = "content"
            return True, Parsed()
        self._state = "calls"
        if self._opener == "{":  # the opener is the first call's own brace
            self._held, self._in_call = text, self._open_call()
        else:
            self._held, self._unclaimed = text[len(self._opener):], text[:len(self._opener)]
        return True, Parsed()

    def _advance_call(self) -> tuple[bool, Parsed]:
        scanner = self._in_call
        self._held = scanner.feed(self._held)
        if scanner.broken and scanner.name is None:
            self._state = "content"
            return True, Parsed(self._drop_last_call())  # the text was never a call
        if scanner.done or scanner.broken:
            self._in_call = None
            return True, Parsed()
        return False, Parsed()

    def _advance_between(self) -> tuple[bool, Parsed]:
        text = self._held.lstrip(_WHITESPACE)
        if not text:
            return False, Parsed()
        if text.startswith(self._separator) or (not self._scanners and text.startswith("{")):
            rest = text[len(self._separator):] if text.startswith(self._separator) else text
            rest = rest.lstrip(_WHITESPACE)
            if not rest:
                self._held = text  # wait for the next call's start
                return False, Parsed()
            self._held = rest
            if rest.startswith("{"):
                self._in_call = self._open_call()
                return True, Parsed()
        if not self._scanners:
            text = self._unclaimed + text  # the opener began no call: it is content too
        elif self._closer and text.startswith(self._closer):
            text = text[len(self._closer):]
        self._state = "content"
        self._held = text
        return True, Parsed()


def hermes() -> ToolCallParser:
    return HermesParser()


def llama3_json() -> ToolCallParser:
    return JsonCallsParser(opener="{", separator=";")


def mistral() -> ToolCallParser:
    return JsonCallsParser(opener="[", separator=",", closer="]", prefix="[TOOL_CALLS]")


def array_of_calls() -> ToolCallParser:
    """The output of tool_choice "required": a JSON array of call objects."""
    return JsonCallsParser(opener="[", separator=",", closer="]")


class NamedCall(ToolCallParser):
    """The output of a named tool_choice: the whole text is the arguments of `name`."""

    def __init__(self, name: str) -> None:
        super().__init__()
        scanner = self._open_call()
        scanner.feed('{"name": ' + json.dumps(name) + ', "arguments": ')

    def feed(self, text: str) -> Parsed:
        self._scanners[0].feed(text)
        return Parsed(calls=self._deltas())

    def finish(self) -> Parsed:
        self._scanners[0].end_value()
        return Parsed(calls=self._deltas())


PARSERS = {"hermes": hermes, "llama3_json": llama3_json, "mistral": mistral}
