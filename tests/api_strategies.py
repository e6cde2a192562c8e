"""Hypothesis strategies for hostile API requests, shared by the parser fuzz (tests/unit) and the
system fuzz (tests/faults): mostly plausible OpenAI bodies with some fields wrong, and GenerateRequests.

Plausible values get a request past the type checks to the limits behind them; arbitrary JSON in any
field, unknown fields, lone surrogates and huge ints probe the type checks themselves.
"""

from __future__ import annotations

import json

from hypothesis import strategies as st

from distserve.v1 import common_pb2, router_pb2

# Any code point, lone surrogates included (hypothesis leaves category Cs out by default, and rarely draws
# one when asked), so one text in three has a lone surrogate put in on purpose.
_ANY_TEXT = st.text(st.characters(exclude_categories=()), max_size=24)
_LONE_SURROGATE = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
SHORT_TEXT = st.text(st.characters(exclude_categories=()), max_size=6)
TEXT = _ANY_TEXT | _ANY_TEXT | st.builds(lambda a, s, b: a + s + b, SHORT_TEXT, _LONE_SURROGATE, SHORT_TEXT)
HUGE_INTS = st.sampled_from([-(2**63), -(2**31) - 1, 2**31, 2**63, 2**64, 10**30])
INTS = st.integers(-5, 300) | HUGE_INTS
FLOATS = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([0.0, 0.5, 1.0, 2.0, -1.0, 1e308])
JSON = st.recursive(st.none() | st.booleans() | INTS | FLOATS | TEXT,
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(SHORT_TEXT, inner, max_size=4),
                    max_leaves=10)


def _plausible(max_tokens: int) -> dict[str, st.SearchStrategy]:
    """A value of the right type, usually in range, per field (max_tokens kept small for the system)."""
    stops = st.lists(TEXT, max_size=20)
    return {
        "prompt": TEXT | st.lists(INTS, min_size=0, max_size=8) | st.lists(TEXT, max_size=2),
        "max_tokens": st.integers(-2, max_tokens) | HUGE_INTS,
        "max_completion_tokens": st.integers(-2, max_tokens),
        "temperature": FLOATS, "top_p": FLOATS, "min_p": FLOATS, "repetition_penalty": FLOATS,
        "presence_penalty": FLOATS, "frequency_penalty": FLOATS,
        "top_k": INTS, "seed": INTS, "min_tokens": st.integers(-1, max_tokens), "n": st.integers(0, 2),
        "stop": TEXT | stops | st.just(["x" * 5000]) | st.just([str(i) for i in range(100)]),
        "stop_token_ids": st.lists(INTS, max_size=6) | st.just(list(range(1000))),
        "stream": st.booleans(), "ignore_eos": st.booleans(),
        "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans() | JSON}),
        "logprobs": st.booleans() | INTS, "logit_bias": st.just({}) | JSON, "user": TEXT | JSON,
        "echo": st.booleans(), "tools": st.just([]) | JSON,
    }


def _fields(plausible: dict[str, st.SearchStrategy]) -> st.SearchStrategy[dict]:
    """Some fields, each with a plausible value or (1 in 4) any JSON; now and then an unknown field."""
    named = st.sampled_from(sorted(plausible)).flatmap(
        lambda name: st.tuples(st.just(name), st.one_of(plausible[name], plausible[name], plausible[name], JSON)))
    unknown = st.tuples(SHORT_TEXT, JSON)
    return st.lists(named | named | named | unknown, max_size=6).map(dict)


def completion_body(model: str, max_tokens: int = 4) -> st.SearchStrategy[dict]:
    plausible = _plausible(max_tokens)
    return st.tuples(st.just(model) | JSON, plausible["prompt"] | JSON, _fields(plausible)).map(
        lambda t: {"model": t[0], "prompt": t[1], **t[2]})


def chat_messages() -> st.SearchStrategy[list]:
    role = st.sampled_from(["system", "user", "assistant", "tool"]) | JSON
    content = TEXT | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}), max_size=2) | JSON
    message = st.fixed_dictionaries({"role": role, "content": content}) | JSON
    return st.lists(message, max_size=3)


def chat_body(model: str, max_tokens: int = 4) -> st.SearchStrategy[dict]:
    plausible = _plausible(max_tokens)
    return st.tuples(st.just(model) | JSON, chat_messages(), _fields(plausible)).map(
        lambda t: {"model": t[0], "messages": t[1], **t[2]})


def dumps(body) -> bytes:
    """JSON as a hostile client sends it: lone surrogates escaped (\\udXXX), NaN and Infinity spelled out."""
    return json.dumps(body, ensure_ascii=True, allow_nan=True).encode()


def generate_request(vocab_size: int, max_tokens: int = 4) -> st.SearchStrategy[router_pb2.GenerateRequest]:
    """A router GenerateRequest with any proto-representable values (proto strings are valid Unicode)."""
    text = st.text(st.characters(exclude_categories=("Cs",)), max_size=24)
    int32 = st.integers(-(2**31), 2**31 - 1)
    token_ids = st.lists(st.integers(-3, vocab_size + 3) | int32, max_size=8) | st.just([1] * 100_000)
    floats = st.floats(width=32, allow_nan=True, allow_infinity=True) | st.sampled_from([0.0, 0.5, 1.0])
    sampling = st.builds(
        common_pb2.SamplingParams,
        max_tokens=st.none() | st.integers(-2, max_tokens) | st.just(2**31 - 1),
        temperature=st.none() | floats, top_p=st.none() | floats, top_k=st.integers(-2, 50) | int32,
        seed=st.none() | st.integers(0, 2**64 - 1),
        stop=st.lists(text, max_size=20) | st.just(["y" * 5000]) | st.just(["s"] * 100_000),
        stop_token_ids=st.lists(st.integers(-3, vocab_size + 3), max_size=6) | st.just([1] * 10_000),
        ignore_eos=st.booleans(), min_tokens=st.integers(-2, max_tokens) | int32,
        repetition_penalty=st.none() | floats, presence_penalty=st.none() | floats,
        frequency_penalty=st.none() | floats, min_p=st.none() | floats,
        logit_bias=st.dictionaries(st.integers(-3, vocab_size + 3) | int32, floats, max_size=4)
        | st.just({t: 1.0 for t in range(400)}))
    prompt = st.one_of(
        text.map(lambda t: {"text": t}),
        st.just({"text": "z" * 2_000_000}),
        token_ids.map(lambda ids: {"token_ids": router_pb2.TokenIds(ids=ids)}),
        st.just({}))
    request_id = st.just("") | st.text(max_size=10) | st.just("r" * 200)
    return st.builds(lambda p, s, r: router_pb2.GenerateRequest(request_id=r, sampling=s, **p),
                     prompt, sampling, request_id)
