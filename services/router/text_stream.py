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

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers before 0.21
    DecodeStream = None


@functools.lru_cache(maxsize=8)
def rust_tokenizer(tokenizer):
    """The tokenizers-library Tokenizer whose decode equals `tokenizer.decode(ids, skip_special_tokens=True)`,
    or None. That holds for a transformers fast tokenizer that does no clean-up of its own; transformers'
    wrapper around it (argument conversion, the clean-up check) took about half of each decode."""
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers layout: its decode, as it is
        return None
    if (isinstance(tokenizer, TokenizersBackend) and type(tokenizer)._decode is TokenizersBackend._decode
            and not _cleans_up_spaces(tokenizer)):
        return tokenizer.backend_tokenizer
    return None


def plain_decoder(tokenizer) -> Callable[[list[int]], str]:
    """A function equal to `tokenizer.decode(ids, skip_special_tokens=True)`: the Rust tokenizer's own
    decode where rust_tokenizer has one, else the tokenizer's."""
    backend = rust_tokenizer(tokenizer)
    if backend is not None:
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
        # The same prefix-offset step in Rust, one call per message (~1 µs a token against ~6 for two
        # decodes from Python); None for tokenizers without it, or once it has failed (then the offsets
        # below, which every step keeps, carry on in Python).
        self._rust, self._rust_stream = rust_tokenizer(tokenizer), None
        if self._rust is not None and DecodeStream is not None:
            self._rust_stream = DecodeStream(skip_special_tokens=True)
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._ids: list[int] = []
        self._prefix_offset = 0  # ids[prefix_offset:read_offset] give context for the next decode
        self._read_offset = 0  # ids before this are decoded
        # decoded text not yet returned: at most the hold-back window plus the last message's text (all
        # text kept would make each `+=` copy the whole answer so far: quadratic in its length)
        self._pending = ""
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
        self._pending += self._decode_new(token_ids)
        # Returned text had no stop string in it or running into the held-back window (else it would
        # have been found then), so a stop string can only start within _pending.
        hits = [at for at in (self._pending.find(stop) for stop in self._stop) if at >= 0]
        if hits:
            self._pending = self._pending[: min(hits)]  # the earliest stop wins, whatever the list order
            self.stopped = True
            return self._release(len(self._pending))
        return self._release(len(self._pending) - self._hold)

    def flush(self) -> str:
        """Everything not yet returned (call once the request has finished)."""
        if not self.stopped:
            self._pending += self._decode(self._prefix_offset, len(self._ids))[
                len(self._decode(self._prefix_offset, self._read_offset)):]
            self._read_offset = len(self._ids)
        return self._release(len(self._pending))

    def _decode(self, start: int, end: int) -> str:
        return self._decode_ids(self._ids[start:end])

    def _decode_new(self, token_ids: list[int]) -> str:
        """The text `token_ids` (just added to _ids) complete, or "" while a character is incomplete."""
        if self._rust_stream is not None:
            try:
                new = self._rust_stream.step(self._rust, token_ids)
            except Exception:  # noqa: BLE001 - e.g. a decode that does not extend its prefix's
                self._rust_stream = None
            else:
                if new:
                    self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
                return new or ""
        prefix = self._decode(self._prefix_offset, self._read_offset)
        full = self._decode(self._prefix_offset, len(self._ids))
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            return full[len(prefix):]
        return ""  # nothing new, or an incomplete character: wait for the next token

    def _release(self, end: int) -> str:
        """_pending's first `end` characters (none if end <= 0), which leave it."""
        if end <= 0:
            return ""
        delta, self._pending = self._pending[:end], self._pending[end:]
        return delta
