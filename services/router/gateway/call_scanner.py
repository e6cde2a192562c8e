"""Reading one tool call, `{"name": "...", "arguments": {...}}`, from model text as it streams in.

`CallScanner` is fed text piece by piece and reports what it learns as soon as it can: the function's
name once its string closes, then the arguments' JSON text in fragments, as OpenAI streams
`delta.tool_calls[i].function.arguments`. It understands JSON's nesting, strings and escapes, so a
`}` or `,` inside an argument string does not end the call. Arguments given as a JSON string
(`"arguments": "{\"a\": 1}"`, as some models write them) are buffered and unquoted at the end.

What it does not do: validate. A call that names no function, or that is not JSON, is `broken`; the
parser that owns the scanner decides what that text then is (plain content).
"""

from __future__ import annotations

import json

ARGUMENT_KEYS = ("arguments", "parameters")  # Hermes and Mistral say "arguments", Llama 3 "parameters"
_WHITESPACE = " \t\r\n"


class CallScanner:
    """One call object, fed in pieces. After each `feed`, `take()` returns what became known."""

    def __init__(self) -> None:
        self.raw: list[str] = []  # every character fed into the object, for when it turns out broken
        self.name: str | None = None
        self.arguments: list[str] = []  # the arguments' JSON text so far
        self.done = False  # the object closed
        self.broken = False  # not a call object: not JSON, or no string name
        self._depth = 0  # 0: before the object; 1: inside it, between its members
        self._key: str | None = None  # the member whose value is being read
        self._token: list[str] = []  # a key, or a value other than the arguments, being read
        self._in_string = self._escaped = False
        self._value_depth = 0  # nesting inside the current value
        self._value_started = False
        self._pending_space = ""  # whitespace after the arguments' value that may be the value's end
        self._quoted_arguments = False
        self._sent_name = False
        self._sent_chars = 0  # of `arguments` already taken

    def feed(self, text: str) -> str:
        """Consumes text up to the object's end; returns what follows it (empty while the call is open)."""
        for i, char in enumerate(text):
            if self.done or self.broken:
                return text[i:]
            self.raw.append(char)
            self._step(char)
        return ""

    def end_value(self) -> None:
        """The text ended where the object's closing brace would come (a named call, whose text is only the
        arguments): closes the call if the arguments are whole; leaves it open (cut off) if not."""
        if self._key is not None and self._value_started and not self._in_string and self._value_depth == 0:
            self._end_value()
            self._close()

    def take(self) -> tuple[str | None, str]:
        """(the name, once and only once it is known; None otherwise), and argument text not yet taken.
        Arguments wait for the name, so the first delta of a call always names its function."""
        if self.name is None or self.broken:
            return None, ""
        name = None if self._sent_name else self.name
        self._sent_name = True
        if self._quoted_arguments and not self.done:
            return name, ""
        text = self.arguments_text()
        fresh = text[self._sent_chars:]
        self._sent_chars = len(text)
        return name, fresh

    def arguments_text(self) -> str:
        """The arguments' JSON text so far ("{}" for a closed call that gave none)."""
        text = "".join(self.arguments)
        if self._quoted_arguments and self.done:
            try:
                text = json.loads(text)
            except ValueError:
                self.broken = True
        if self.done and not text.strip():
            return "{}"
        return text

    def _step(self, char: str) -> None:
        if self._depth == 0:
            if char == "{":
                self._depth = 1
            elif char not in _WHITESPACE:
                self.broken = True
        elif self._key is None:
            self._between_members(char)
        else:
            self._in_value(char)

    def _between_members(self, char: str) -> None:
        """Inside the object, outside any value: keys, colons, commas, the closing brace."""
        if self._token:  # reading a key
            self._token.append(char)
            if self._string_step(char):
                return
            try:
                key = json.loads("".join(self._token))
            except ValueError:
                self.broken = True
                return
            self._token = []
            self._key = key  # the value follows its colon
            self._value_started = False
            return
        if char == '"':
            self._token = [char]
            self._in_string = True
        elif char == "}":
            self._close()
        elif char not in _WHITESPACE + ",":
            self.broken = True

    def _in_value(self, char: str) -> None:
        if not self._value_started:
            if char in _WHITESPACE or char == ":":
                return
            self._value_started = True
            self._quoted_arguments = self._key in ARGUMENT_KEYS and char == '"'
        at_end = (not self._in_string and self._value_depth == 0 and char in ",}")
        if at_end:
            self._end_value()
            if char == "}":
                self._close()
            return
        if self._in_string:
            self._string_step(char)
        elif char == '"':
            self._in_string = True
        elif char in "{[":
            self._value_depth += 1
        elif char in "}]":
            self._value_depth -= 1
        self._keep(char)

    def _keep(self, char: str) -> None:
        if self._key not in ARGUMENT_KEYS:
            self._token.append(char)
        elif char in _WHITESPACE and not self._in_string and self._value_depth == 0:
            self._pending_space += char  # trailing whitespace after the value is not the arguments'
        else:
            self.arguments.append(self._pending_space + char)
            self._pending_space = ""

    def _end_value(self) -> None:
        if self._key == "name":
            try:
                name = json.loads("".join(self._token))
            except ValueError:
                name = None
            if not isinstance(name, str) or not name:
                self.broken = True
            self.name = name if isinstance(name, str) else None
        self._key, self._token, self._pending_space = None, [], ""

    def _close(self) -> None:
        self._depth = 0
        self.done = True
        if self.name is None:
            self.broken = True

    def _string_step(self, char: str) -> bool:
        """Advances string state over `char` (already inside a string); True while the string stays open."""
        if self._escaped:
            self._escaped = False
        elif char == "\\":
            self._escaped = True
        elif char == '"':
            self._in_string = False
        return self._in_string
