"""Hostile request bodies at the gateway's parser: each is a 400 naming the problem, never an exception.

The property tests feed the parser arbitrary JSON (and arbitrary bytes): whatever it
does not refuse with a 4xx ApiError must become a router request that protobuf can
serialize. What the running system answers is tested in tests/faults/test_fuzz.py.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from distserve.engine.model_loader import load_tokenizer
from services.router.gateway.chat_template import ChatTemplate
from services.router.gateway.errors import ApiError
from services.router.gateway.json_fields import MAX_JSON_DEPTH, parse_json_object
from services.router.gateway.openai_protocol import parse_chat, parse_completion
from services.router.validation import MAX_CHARS_PER_TOKEN
from tests.api_strategies import TEXT, chat_body, completion_body, dumps

MODEL = "distserve-tiny"
MAX_CONTEXT = 64


@pytest.fixture(scope="module")
def template(tiny_model_path) -> ChatTemplate:
    return ChatTemplate(load_tokenizer(tiny_model_path), MAX_CONTEXT)


def refusal(raw: bytes, parse=parse_completion, *args) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse(parse_json_object(raw), *args)
    assert info.value.status == 400, info.value
    return info.value


HOSTILE_BODIES = {
    "deeply-nested-array": (b"[" * 100_000, None, "nests"),
    "deeply-nested-object": (b'{"a":' * 100_000, None, "nests"),
    "nested-past-the-limit": (b'{"model": "m", "prompt": "x", "user": ' + b"[" * MAX_JSON_DEPTH
                              + b"]" * MAX_JSON_DEPTH + b"}", "user", "nests"),
    "lone-high-surrogate-in-prompt": (b'{"model": "m", "prompt": "a\\ud800b"}', "prompt", "surrogate"),
    "lone-low-surrogate-in-stop": (b'{"model": "m", "prompt": "a", "stop": ["x", "\\uDC00"]}', "stop[1]",
                                   "surrogate"),
    "surrogate-in-a-key": (b'{"model": "m", "prompt": "a", "\\ud800": 1}', None, "surrogate"),
    "invalid-utf8": (b'{"model": "m", "prompt": "\xff\xfe"}', None, "UTF-8"),
    "array-body": (b"[1, 2]", None, "JSON object"),
    "string-body": (b'"prompt"', None, "JSON object"),
    "null-body": (b"null", None, "JSON object"),
    "empty-body": (b"", None, "not valid JSON"),
    "nan": (b'{"model": "m", "prompt": "a", "temperature": NaN}', None, "not valid JSON"),
}


@pytest.mark.parametrize("raw, param, words", HOSTILE_BODIES.values(), ids=HOSTILE_BODIES.keys())
def test_hostile_bodies_are_400_naming_the_problem(raw, param, words):
    error = refusal(raw)
    assert error.param == param and words in error.message


def test_a_valid_surrogate_pair_is_text():
    request = parse_completion(parse_json_object(b'{"model": "m", "prompt": "\\ud83d\\ude00"}'))
    assert request.to_router("r").text == "\U0001F600"


def test_a_surrogate_in_a_chat_message_names_the_message(template):
    raw = b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}'
    assert refusal(raw, parse_chat, template).param == "messages[0].content[0].text"


def test_chat_content_too_long_to_fit_is_refused_before_templating(template):
    content = "a" * (MAX_CONTEXT * MAX_CHARS_PER_TOKEN + 1)
    raw = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": content}]}).encode()
    error = refusal(raw, parse_chat, template)
    assert error.param == "messages" and "cannot fit" in error.message


def _parse_or_refuse(raw: bytes, parse, *args) -> None:
    try:
        request = parse(parse_json_object(raw), *args)
    except ApiError as exc:
        assert 400 <= exc.status < 500 and exc.message, exc
        return
    request.to_router("fuzz").SerializeToString()  # what the gateway sends must be a valid message


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=completion_body(MODEL))
def test_any_json_completion_body_is_parsed_or_refused_with_a_4xx(body):
    _parse_or_refuse(dumps(body), parse_completion)


@settings(max_examples=100, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(body=chat_body(MODEL))
def test_any_json_chat_body_is_parsed_or_refused_with_a_4xx(template, body):
    _parse_or_refuse(dumps(body), parse_chat, template)


@settings(max_examples=100, deadline=None, database=None)
@given(raw=st.binary(max_size=64) | TEXT.map(lambda t: t.encode("utf-8", "surrogatepass")))
def test_any_bytes_are_parsed_or_refused_with_a_4xx(raw):
    _parse_or_refuse(raw, parse_completion)
