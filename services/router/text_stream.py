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
        self._text = self._tokenizer.decode(self._ids, skip_special_tokens=True)
        # Text before _emitted is final, so a stop string can only start within the hold-back window.
        search_from = max(0, self._emitted - self._hold)
        hits = [at for at in (self._text.find(stop, search_from) for stop in self._stop) if at >= 0]
        if hits:
            self._text = self._text[: min(hits)]  # the earliest stop wins, whatever the list order
            self.stopped = True
            return self._release(len(self._text))
        end = len(self._text)
        while end > self._emitted and self._text[end - 1] == "\ufffd":
            end -= 1  # an incomplete UTF-8 sequence: the next token completes it
        return self._release(end - self._hold)

    def flush(self) -> str:
        """Everything not yet returned (call once the request has finished)."""
        return self._release(len(self._text))

    def _release(self, end: int) -> str:
        if end <= self._emitted:
            return ""
        delta, self._emitted = self._text[self._emitted:end], end
        return delta
