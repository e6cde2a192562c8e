"""Structured output through the whole system with the openai SDK: every answer parses and follows its
grammar (the first token is masked at prefill, the rest at decode), streamed or not, for n > 1 too; a
grammar that does not compile is a 400 naming the field."""

from __future__ import annotations

import json
import re

import openai
import pytest

from tests.builders import generate, token_request

MODEL = "distserve-tiny"
# Bounded everywhere (string lengths, integer range, enum), so even random weights reach the end well
# within max_tokens: a grammar only guarantees parseable output if the answer is allowed to finish.
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"enum": ["admin", "user", "guest"]},
    "active": {"type": "boolean"}}, "required": ["name", "age", "role", "active"]}
MAX_TOKENS = 120


def check_person(text: str) -> None:
    person = json.loads(text)
    assert set(person) == {"name", "age", "role", "active"}  # strict: nothing beyond the properties
    assert isinstance(person["name"], str) and len(person["name"]) <= 8
    assert isinstance(person["age"], int) and 0 <= person["age"] <= 120
    assert person["role"] in ("admin", "user", "guest") and isinstance(person["active"], bool)


@pytest.fixture(scope="module")
def sdk(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.gateway_url + "/v1", api_key="any", max_retries=0)


def person_format() -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_chat_json_schema_output_validates(sdk, temperature):
    reply = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Who are you?"}],
                                        max_tokens=MAX_TOKENS, temperature=temperature, seed=3,
                                        response_format=person_format())
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"  # the grammar completed: the request ended there
    check_person(choice.message.content)


def test_streamed_json_schema_output_validates(sdk):
    chunks = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Describe a user."}],
                                         max_tokens=MAX_TOKENS, temperature=1.0, seed=5, stream=True,
                                         response_format=person_format())
    check_person("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))


def test_n_completions_each_validate_and_differ(sdk):
    reply = sdk.completions.create(model=MODEL, prompt="A user record:", max_tokens=MAX_TOKENS, temperature=1.0,
                                   seed=7, n=3, extra_body={"response_format": person_format()})
    texts = [c.text for c in reply.choices]
    for text in texts:
        check_person(text)
    assert len(set(texts)) > 1


def test_json_object_gives_an_object(sdk):
    reply = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "JSON please"}],
                                        max_tokens=200, temperature=0, response_format={"type": "json_object"})
    if reply.choices[0].finish_reason == "stop":  # any object: the model may write one longer than 200 tokens
        assert isinstance(json.loads(reply.choices[0].message.content), dict)
    else:
        assert reply.choices[0].message.content.startswith("{")


@pytest.mark.parametrize("spec, check", [
    ({"choice": ["red", "green", "blue"]}, lambda text: text in ("red", "green", "blue")),
    ({"regex": "[0-9]{3}-[a-z]{2,4}"}, lambda text: re.fullmatch("[0-9]{3}-[a-z]{2,4}", text) is not None),
    ({"grammar": 'root ::= ("yes" | "no") " " [0-9]'}, lambda text: re.fullmatch("(yes|no) [0-9]", text) is not None),
])
def test_vllm_structured_outputs(sdk, spec, check):
    for seed in (1, 2):
        reply = sdk.completions.create(model=MODEL, prompt="Answer:", max_tokens=30, temperature=1.0, seed=seed,
                                       extra_body={"structured_outputs": spec})
        assert reply.choices[0].finish_reason == "stop" and check(reply.choices[0].text), reply.choices[0].text


def test_grpc_choice_ends_even_with_ignore_eos(cluster):
    from distserve.v1 import common_pb2
    request = token_request([5, 6, 7], max_tokens=30, temperature=1.0, seed=4, ignore_eos=True)
    request.sampling.structured_output.CopyFrom(
        common_pb2.StructuredOutput(choice=common_pb2.StringList(values=["alpha", "beta"])))
    answer = generate(cluster.router_address, request)
    assert answer.text in ("alpha", "beta") and answer.last.finish_reason == common_pb2.FINISH_REASON_STOP


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}},
     "response_format"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "start ::= \"a\""}}, "structured_outputs"),  # no root rule
    ({"structured_outputs": {"regex": "a" * (1 << 20)}}, "structured_outputs"),  # 1 MiB: over the size cap
])
def test_a_grammar_that_does_not_compile_is_a_400_naming_the_field(sdk, fields, param):
    with pytest.raises(openai.BadRequestError) as info:
        sdk.completions.create(model=MODEL, prompt="x", max_tokens=5, extra_body=fields)
    assert info.value.body["param"] == param
