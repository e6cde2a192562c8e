"""Incremental detokenization with stop strings.

Text is released only when it is final: a trailing incomplete UTF-8 sequence
(decoded as U+FFFD) and the last (longest stop string - 1) characters are held
back, since the next token may complete them. The stop string itself and
anything after it are never returned.
"""

from __future__ import annotations


class TextStream:
    def __init__(self, tokenizer, stop: tuple[str, ...]):
        self._tokenizer = tokenizer
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._ids: list[int] = []
        self._text = ""
        self._emitted = 0
        self.stopped = False

    def add(self, token_ids: list[int]) -> str:
        """Adds tokens; returns the newly final text. Sets `stopped` when a stop string appears."""
        self._ids.extend(token_ids)
        search_from = max(0, len(self._text) - self._hold)
        self._text = self._tokenizer.decode(self._ids, skip_special_tokens=True)
        for stop in self._stop:
            at = self._text.find(stop, search_from)
            if at >= 0:  # later stops search the cut text, so the earliest match wins
                self._text = self._text[:at]
                self.stopped = True
        if self.stopped:
            return self._release(len(self._text))
        end = len(self._text) - self._hold
        while end > self._emitted and self._text[end - 1] == "\ufffd":
            end -= 1
        return self._release(end)

    def flush(self) -> str:
        """Everything not yet returned (call once the request has finished)."""
        return self._release(len(self._text))

    def _release(self, end: int) -> str:
        if end <= self._emitted:
            return ""
        delta, self._emitted = self._text[self._emitted:end], end
        return delta
