"""Incremental detokenization with stop strings.

Each step decodes only a short window of ids (the prefix-offset method of vLLM
and TGI), so a long generation costs linear, not quadratic, time. Text is
released only when it is final: bytes of an incomplete UTF-8 character stay
undecoded until the character completes, and the last (longest stop string - 1)
characters are held back, since the next token may complete a stop string. The
stop string itself and anything after it are never returned.
"""

from __future__ import annotations

import functools
from typing import Callable


@functools.lru_cache(maxsize=8)
def plain_decoder(tokenizer) -> Callable[[list[int]], str]:
    """A function equal to `tokenizer.decode(ids, skip_special_tokens=True)`. For a transformers fast
    tokenizer that does no clean-up of its own, that is its Rust tokenizer's decode: transformers'
    wrapper around it (argument conversion, the clean-up check) took about half of each call, and the
    router decodes twice per streamed token. Any other tokenizer keeps its own decode."""
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers layout: its decode, as it is
        TokenizersBackend = None
    if (TokenizersBackend is not None and isinstance(tokenizer, TokenizersBackend)
            and type(tokenizer)._decode is TokenizersBackend._decode and not _cleans_up_spaces(tokenizer)):
        backend = tokenizer.backend_tokenizer
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


def _cleans_up_spaces(tokenizer) -> bool:
    """Whether transformers' decode edits the backend's text (clean_up_tokenization_spaces, which it
    skips for BPE models unless forced: TokenizersBackend._decode)."""
    if not tokenizer.clean_up_tokenization_spaces:
        return False
    forced = getattr(tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)
    return type(tokenizer.backend_tokenizer.model).__name__ != "BPE" or bool(forced)


class TextStream:
    def __init__(self, tokenizer, stop: tuple[str, ...]):
        self._decode_ids = plain_decoder(tokenizer)
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._ids: list[int] = []
        self._prefix_offset = 0  # ids[prefix_offset:read_offset] give context for the next decode
        self._read_offset = 0  # ids before this are in _text
        self._text = ""
        self._emitted = 0
        self.stopped = False

    @property
    def has_stop_strings(self) -> bool:
        return bool(self._stop)

    def add(self, token_ids: list[int]) -> str:
        """Adds tokens; returns the newly final text. Sets `stopped` when a stop string appears;
        after that, further tokens add nothing."""
        if self.stopped:
            return ""
        self._ids.extend(token_ids)
        self._text += self._decode_new()
        # Text before _emitted is final, so a stop string can only start within the hold-back window.
        search_from = max(0, self._emitted - self._hold)
        hits = [at for at in (self._text.find(stop, search_from) for stop in self._stop) if at >= 0]
        if hits:
            self._text = self._text[: min(hits)]  # the earliest stop wins, whatever the list order
            self.stopped = True
            return self._release(len(self._text))
        return self._release(len(self._text) - self._hold)

    def flush(self) -> str:
        """Everything not yet returned (call once the request has finished)."""
        if not self.stopped:
            self._text += self._decode(self._prefix_offset, len(self._ids))[
                len(self._decode(self._prefix_offset, self._read_offset)):]
            self._read_offset = len(self._ids)
        return self._release(len(self._text))

    def _decode(self, start: int, end: int) -> str:
        return self._decode_ids(self._ids[start:end])

    def _decode_new(self) -> str:
        prefix = self._decode(self._prefix_offset, self._read_offset)
        full = self._decode(self._prefix_offset, len(self._ids))
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            return full[len(prefix):]
        return ""  # nothing new, or an incomplete character: wait for the next token

    def _release(self, end: int) -> str:
        if end <= self._emitted:
            return ""
        delta, self._emitted = self._text[self._emitted:end], end
        return delta
