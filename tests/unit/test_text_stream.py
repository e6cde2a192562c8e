"""TextStream: incremental text, held-back partial characters and stop strings that span tokens."""

from __future__ import annotations

import pytest

from services.router.text_stream import TextStream, plain_decoder


class ByteTokenizer:
    """Each token is one UTF-8 byte, so a multi-byte character always spans tokens."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def byte_ids(text: str) -> list[int]:
    return list(text.encode())


def feed(stream: TextStream, ids: list[int], chunk: int = 1) -> list[str]:
    """Adds ids `chunk` at a time; returns each call's delta."""
    return [stream.add(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]


def stream_text(text: str, stop: tuple[str, ...] = (), chunk: int = 1) -> tuple[str, bool]:
    """What the client sees for `text` streamed byte by byte: (all deltas + flush, stopped)."""
    stream = TextStream(ByteTokenizer(), stop)
    released = "".join(feed(stream, byte_ids(text), chunk))
    return released + stream.flush(), stream.stopped


def test_without_stop_strings_each_token_is_released_at_once():
    stream = TextStream(ByteTokenizer(), ())
    assert feed(stream, byte_ids("abc")) == ["a", "b", "c"]
    assert stream.flush() == "" and not stream.stopped


def test_incomplete_utf8_is_held_until_the_character_completes():
    stream = TextStream(ByteTokenizer(), ())
    deltas = feed(stream, byte_ids("a\u00e9\u65e5b"))  # a, é (2 bytes), 日 (3 bytes), b
    assert deltas == ["a", "", "\u00e9", "", "", "\u65e5", "b"]
    assert all("\ufffd" not in d for d in deltas)


@pytest.mark.parametrize("chunk", [1, 2, 3, 100])
def test_released_text_adds_up_to_the_decoded_text(chunk):
    text = "h\u00e9llo, \u65e5\u672c! \U0001f600 ok"
    assert stream_text(text, chunk=chunk) == (text, False)
    assert stream_text(text, stop=("zzz",), chunk=chunk) == (text, False)


def test_text_that_may_start_a_stop_string_is_held_back_then_flushed():
    stream = TextStream(ByteTokenizer(), ("STOP",))
    assert "".join(feed(stream, byte_ids("hello"))) == "he"  # the last 3 chars could begin "STOP"
    assert stream.flush() == "llo"
    assert not stream.stopped


def test_partial_stop_that_never_completes_is_released():
    stream = TextStream(ByteTokenizer(), ("END",))
    assert "".join(feed(stream, byte_ids("xEN"))) == "x"
    assert stream.add(byte_ids("!!")) == "EN"
    assert stream.flush() == "!!"


@pytest.mark.parametrize("chunk", [1, 2, 4])
def test_stop_string_spanning_tokens_is_cut_with_everything_after(chunk):
    assert stream_text("abEND and more", stop=("END",), chunk=chunk) == ("ab", True)


def test_stop_inside_one_add_drops_the_rest_of_that_add():
    stream = TextStream(ByteTokenizer(), ("\n\n",))
    assert stream.add(byte_ids("one\n\ntwo")) == "one"
    assert stream.stopped and stream.flush() == ""


def test_nothing_after_the_stop_is_released_by_later_adds():
    stream = TextStream(ByteTokenizer(), ("#",))
    assert stream.add(byte_ids("ab#")) == "ab"
    assert stream.add(byte_ids("cd")) == ""
    assert stream.flush() == ""


def test_stop_at_the_very_start_releases_nothing():
    assert stream_text("ENDabc", stop=("END",)) == ("", True)


@pytest.mark.parametrize("stop", [("xyz", "b"), ("b", "xyz")])
def test_earliest_stop_wins_whatever_the_list_order(stop):
    assert stream_text("abxyzb", stop=stop, chunk=6) == ("a", True)


@pytest.mark.parametrize("stop", [("cd", "bcd"), ("bcd", "cd")])
def test_earliest_of_overlapping_stops_wins_whatever_the_list_order(stop):
    assert stream_text("abcde", stop=stop, chunk=5) == ("a", True)


@pytest.mark.parametrize("stop", [("\u65e5",), ("b\u65e5",), ("\u65e5c",)])
def test_stop_string_with_a_multibyte_character_split_over_tokens(stop):
    text, stopped = stream_text("ab\u65e5cd", stop=stop)
    assert stopped
    assert text == "ab\u65e5cd".split(stop[0])[0]


def test_real_tokenizer_stream_matches_its_decode(tiny_tokenizer):
    text = "Hello world, h\u00e9llo \u65e5\u672c END stop"
    ids = tiny_tokenizer(text)["input_ids"]
    full = tiny_tokenizer.decode(ids, skip_special_tokens=True)
    stream = TextStream(tiny_tokenizer, ())
    deltas = feed(stream, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + stream.flush() == full


@pytest.mark.parametrize("stop", [" END", "\u672c"])
def test_real_tokenizer_stop_string(tiny_tokenizer, stop):
    text = "Hello world, h\u00e9llo \u65e5\u672c END stop"
    ids = tiny_tokenizer(text)["input_ids"]
    stream = TextStream(tiny_tokenizer, (stop,))
    released = "".join(feed(stream, ids)) + stream.flush()
    assert stream.stopped
    assert released == text.split(stop)[0]


def test_plain_decoder_equals_decode_skipping_special_tokens(tiny_tokenizer):
    import random

    rng = random.Random(0)
    special = [i for i in (tiny_tokenizer.bos_token_id, tiny_tokenizer.eos_token_id) if i is not None]
    decode = plain_decoder(tiny_tokenizer)
    for length in (0, 1, 2, 7, 50):
        ids = [rng.randrange(tiny_tokenizer.vocab_size) for _ in range(length)] + special
        rng.shuffle(ids)
        assert decode(ids) == tiny_tokenizer.decode(ids, skip_special_tokens=True)


def test_plain_decoder_takes_the_rust_decode_only_where_it_equals_transformers(tiny_tokenizer, monkeypatch):
    from services.router import text_stream

    assert plain_decoder(tiny_tokenizer).__closure__[0].cell_contents is tiny_tokenizer.backend_tokenizer
    text_stream.rust_tokenizer.cache_clear()
    monkeypatch.setattr(text_stream, "_cleans_up_spaces", lambda tokenizer: True)
    assert plain_decoder(tiny_tokenizer).__closure__[0].cell_contents is tiny_tokenizer  # its own decode
    assert TextStream(tiny_tokenizer, ())._rust_stream is None  # nor the Rust stream
    text_stream.rust_tokenizer.cache_clear()


class _BrokenStream:
    def step(self, tokenizer, ids):
        raise Exception("decode stream failed")


def _deltas(tokenizer, messages, stop, rust: bool, fail_after: int | None = None) -> list[str]:
    stream = TextStream(tokenizer, stop)
    assert (stream._rust_stream is not None) or not rust
    if not rust:
        stream._rust_stream = None
    deltas = []
    for i, message in enumerate(messages):
        if i == fail_after:  # the Rust stream breaks mid-answer: Python carries on from its offsets
            stream._rust_stream = _BrokenStream()
        deltas.append(stream.add(message))
    return deltas + [stream.flush()]


@pytest.mark.parametrize("per_message", [1, 3])
@pytest.mark.parametrize("stop", [(), ("e",), (" the", "zz q")])
def test_the_rust_stream_releases_what_two_decodes_per_message_release(tiny_tokenizer, per_message, stop):
    import random

    rng = random.Random(per_message)
    ids = [rng.randrange(tiny_tokenizer.vocab_size) for _ in range(300)]
    ids += tiny_tokenizer("h\u00e9llo \u65e5\u672c \U0001F600 the end", add_special_tokens=False)["input_ids"] * 3
    messages = [ids[i:i + per_message] for i in range(0, len(ids), per_message)]
    python = _deltas(tiny_tokenizer, messages, stop, rust=False)
    assert _deltas(tiny_tokenizer, messages, stop, rust=True) == python
    assert _deltas(tiny_tokenizer, messages, stop, rust=True, fail_after=len(messages) // 2) == python


@pytest.mark.parametrize("model, clean_up, forced, cleans", [
    ("BPE", False, False, False), ("BPE", True, False, False), ("BPE", True, True, True),
    ("WordPiece", True, False, True), ("WordPiece", False, False, False)])
def test_clean_up_is_seen_as_transformers_applies_it(model, clean_up, forced, cleans):
    from types import SimpleNamespace

    from services.router.text_stream import _cleans_up_spaces

    tokenizer = SimpleNamespace(
        clean_up_tokenization_spaces=clean_up, backend_tokenizer=SimpleNamespace(model=type(model, (), {})()),
        clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output=forced)
    assert _cleans_up_spaces(tokenizer) is cleans


def test_plain_decoder_of_another_tokenizer_is_its_decode():
    assert plain_decoder(ByteTokenizer())(byte_ids("h\u00e9")) == "h\u00e9"
