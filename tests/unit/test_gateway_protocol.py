"""OpenAI request bodies -> router GenerateRequest: field mapping, defaults left to the router, bad fields named."""

from __future__ import annotations

import json

import grpc
import pytest

from distserve.engine.model_loader import load_tokenizer
from distserve.request_types import SamplingParams
from services.router.gateway.chat_template import ChatTemplate
from services.router.gateway.errors import ApiError, from_router_error
from services.router.gateway.json_fields import parse_json_object
from services.router.gateway.openai_protocol import Endpoint, check_model, parse_chat, parse_completion
from services.router.validation import InvalidRequest, validate_request
from tests.builders import model_spec

MODEL = "distserve-tiny"
SPEC = model_spec(vocab_size=256, max_context=64)  # for the router's validation of what the gateway sends


@pytest.fixture(scope="module")
def template(tiny_model_path) -> ChatTemplate:
    return ChatTemplate(load_tokenizer(tiny_model_path))


def body(**fields):
    return parse_json_object(json.dumps({"model": MODEL, **fields}).encode())


def completion(**fields):
    return parse_completion(body(**fields))


def error_of(call, *args) -> ApiError:
    with pytest.raises(ApiError) as info:
        call(*args)
    return info.value


def test_unset_sampling_fields_stay_unset_so_the_router_applies_its_defaults():
    request = completion(prompt="hello")
    sampling = request.to_router("r1").sampling
    assert not sampling.HasField("max_tokens") and not sampling.HasField("temperature")
    assert not sampling.HasField("top_p") and not sampling.HasField("seed")
    assert (request.endpoint, request.stream, request.include_usage) == (Endpoint.COMPLETIONS, False, False)


def test_every_honoured_field_reaches_the_router_request():
    request = completion(prompt="hello", max_tokens=7, temperature=0.5, top_p=0.25, seed=42, stop="\n", n=1,
                         top_k=5, ignore_eos=True, stop_token_ids=[3, 4], min_tokens=2, user="u",
                         stream=True, stream_options={"include_usage": True})
    wire = request.to_router("req-1")
    assert wire.request_id == "req-1" and wire.text == "hello"
    s = wire.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.seed, list(s.stop)) == (7, 0.5, 0.25, 42, ["\n"])
    assert (s.top_k, s.ignore_eos, list(s.stop_token_ids), s.min_tokens) == (5, True, [3, 4], 2)
    assert request.stream and request.include_usage


def test_token_prompts_and_single_element_batches():
    assert list(completion(prompt=[5, 6, 7]).to_router("r").token_ids.ids) == [5, 6, 7]
    assert list(completion(prompt=[[5, 6]]).to_router("r").token_ids.ids) == [5, 6]
    assert completion(prompt=["only one"]).to_router("r").text == "only one"


def test_vllm_top_k_minus_one_means_off_and_negative_seeds_wrap():
    sampling = completion(prompt="x", top_k=-1, seed=-1).sampling
    assert sampling.top_k == 0 and sampling.seed == 2**64 - 1


def test_off_values_of_unsupported_features_are_accepted():
    request = completion(prompt="x", logprobs=None, echo=False, best_of=1, logit_bias={})
    assert request.to_router("r").text == "x"


def test_logprobs_echo_n_best_of_and_user_reach_the_router_request():
    routed = completion(prompt="x", logprobs=0, echo=True, n=2, best_of=3, user="alice").to_router("r")
    assert routed.sampling.logprobs == 0  # 0: the chosen tokens' logprobs, no alternatives
    assert routed.sampling.prompt_logprobs == 0  # echoed prompt tokens carry logprobs too
    assert (routed.echo, routed.n, routed.best_of, routed.user) == (True, 2, 3, "alice")
    assert not completion(prompt="x").to_router("r").sampling.HasField("logprobs")


def test_chat_logprobs_are_a_boolean_plus_top_logprobs(template):
    messages = [{"role": "user", "content": "hi"}]
    assert parse_chat(body(messages=messages, logprobs=True, top_logprobs=4), template).sampling.logprobs == 4
    assert parse_chat(body(messages=messages, logprobs=True), template).sampling.logprobs == 0
    assert not parse_chat(body(messages=messages, logprobs=False), template).sampling.HasField("logprobs")


@pytest.mark.parametrize("fields, expected", [
    ({"response_format": {"type": "json_object"}}, {"json_object": True}),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "integer"}}}},
     {"json_schema": '{"type": "integer"}'}),
    ({"response_format": {"type": "text"}}, {}),
    ({"structured_outputs": {"regex": "[ab]+"}}, {"regex": "[ab]+"}),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, {"choice": {"values": ["yes", "no"]}}),
    ({"structured_outputs": {"json": {"type": "boolean"}}}, {"json_schema": '{"type": "boolean"}'}),
    ({"structured_outputs": {"grammar": "root ::= \"a\""}}, {"grammar": 'root ::= "a"'}),
])
def test_structured_output_fields_reach_the_router_request(fields, expected):
    from google.protobuf.json_format import MessageToDict
    sampling = completion(prompt="x", **fields).sampling
    assert MessageToDict(sampling.structured_output, preserving_proto_field_name=True) == expected


def test_sampler_fields_reach_the_router_request():
    sampling = completion(prompt="x", presence_penalty=0.5, frequency_penalty=-1, repetition_penalty=1.25,
                          min_p=0.125).sampling
    assert (sampling.presence_penalty, sampling.frequency_penalty) == (0.5, -1.0)
    assert (sampling.repetition_penalty, sampling.min_p) == (1.25, 0.125)
    unset = completion(prompt="x", presence_penalty=None).sampling
    assert not any(unset.HasField(f) for f in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p"))


# What `vllm bench serve --backend vllm` posts to /v1/completions (vllm/benchmarks/lib/endpoint_request_func.py):
# temperature 0.0 is its default; --ignore-eos adds ignore_eos.
VLLM_BENCH_COMPLETION = {"model": MODEL, "prompt": "The quick brown fox", "repetition_penalty": 1.0, "max_tokens": 16,
                         "logprobs": None, "stream": True, "stream_options": {"include_usage": True},
                         "temperature": 0.0, "ignore_eos": True}


def test_the_vllm_bench_serve_completion_body_is_accepted_and_mapped():
    request = parse_completion(parse_json_object(json.dumps(VLLM_BENCH_COMPLETION).encode()))
    assert (request.endpoint, request.model, request.stream, request.include_usage) == \
        (Endpoint.COMPLETIONS, MODEL, True, True)
    wire = request.to_router("r")
    assert wire.text == "The quick brown fox"
    s = wire.sampling
    assert s.HasField("temperature") and s.temperature == 0.0 and s.max_tokens == 16 and s.ignore_eos
    assert s.HasField("repetition_penalty") and s.repetition_penalty == 1.0
    _, params = validate_request(wire, lambda text: {"input_ids": list(range(2, 2 + len(text.split())))}, SPEC)
    assert params == SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    assert params.is_greedy and not params.has_penalties


def test_vllm_bench_serve_sampler_flags_are_accepted_on_both_endpoints(template):
    # --top-p --top-k --min-p --temperature --frequency-penalty --presence-penalty --repetition-penalty
    flags = {"top_p": 0.75, "top_k": 20, "min_p": 0.0625, "temperature": 0.5, "frequency_penalty": 0.25,
             "presence_penalty": -0.5, "repetition_penalty": 1.5}
    chat_body = {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                 "max_completion_tokens": 8, "stream": True, "stream_options": {"include_usage": True},
                 "ignore_eos": True, **flags}
    chat = parse_chat(parse_json_object(json.dumps(chat_body).encode()), template)
    completion_ = parse_completion(parse_json_object(json.dumps({**VLLM_BENCH_COMPLETION, **flags}).encode()))
    for request in (chat, completion_):
        s = request.sampling
        assert (s.top_p, s.top_k, s.min_p, s.temperature) == (0.75, 20, 0.0625, 0.5)
        assert (s.frequency_penalty, s.presence_penalty, s.repetition_penalty) == (0.25, -0.5, 1.5)
    assert chat.sampling.max_tokens == 8 and chat.stream and chat.include_usage


@pytest.mark.parametrize("field, value", [
    ("repetition_penalty", 0), ("repetition_penalty", -1.0), ("presence_penalty", 2.5),
    ("presence_penalty", -3), ("frequency_penalty", 2.01), ("frequency_penalty", -10), ("min_p", 1.5),
    ("min_p", -0.1), ("repetition_penalty", 1e39),  # overflows the wire's float32 to inf
])
def test_out_of_range_sampler_values_are_400_naming_the_param(field, value):
    """The gateway checks types; the router checks ranges, and its error names the client's field."""
    request = completion(prompt=[5, 6], **{field: value})
    with pytest.raises(InvalidRequest) as exc:
        validate_request(request.to_router("r"), None, SPEC)
    error = from_router_error(grpc.StatusCode.INVALID_ARGUMENT, str(exc.value), request.params, 1)
    assert (error.status, error.param) == (400, field)
    assert error.message.startswith(field + ":")


@pytest.mark.parametrize("fields, param", [
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "temperature": True}, "temperature"),
    ({"prompt": "x", "max_tokens": 1.5}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 2**31}, "max_tokens"),
    ({"prompt": "x", "top_p": [1]}, "top_p"),
    ({"prompt": "x", "seed": 2**64}, "seed"),
    ({"prompt": "x", "stop": [1, 2]}, "stop"),
    ({"prompt": "x", "stop_token_ids": ["a"]}, "stop_token_ids"),
    ({"prompt": "x", "ignore_eos": "yes"}, "ignore_eos"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "n": "2"}, "n"),
    ({"prompt": "x", "stream": "true"}, "stream"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "x", "stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ({"prompt": "x", "stream": True, "stream_options": {"extra": True}}, "stream_options.extra"),
    ({"prompt": "x", "user": 5}, "user"),
    ({"prompt": "x", "presence_penalty": "x"}, "presence_penalty"),
    ({"prompt": "x", "frequency_penalty": True}, "frequency_penalty"),
    ({"prompt": "x", "repetition_penalty": "1.0"}, "repetition_penalty"),
    ({"prompt": "x", "min_p": [0.1]}, "min_p"),
    ({"prompt": "x", "logprobs": True}, "logprobs"),  # completions take a count; chat takes the boolean
    ({"prompt": "x", "logprobs": "1"}, "logprobs"),
    ({"prompt": "x", "echo": "yes"}, "echo"),
    ({"prompt": "x", "best_of": "3"}, "best_of"),
    ({"prompt": "x", "best_of": 3, "stream": True}, "best_of"),  # the best are known only at the end
    ({"prompt": "x", "response_format": {"type": "yaml"}}, "response_format.type"),
    ({"prompt": "x", "response_format": {"type": "json_schema", "json_schema": 5}}, "response_format.json_schema"),
    ({"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"prompt": "x", "structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"prompt": "x", "structured_outputs": {"colour": "red"}}, "structured_outputs.colour"),
    ({"prompt": "x", "prompt_logprobs": "2"}, "prompt_logprobs"),
    ({"prompt": "x", "frobnicate": 1}, "frobnicate"),
    ({"prompt": "x", "messages": []}, "messages"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": [1, 2**31]}, "prompt"),
    ({}, "prompt"),
])
def test_bad_completion_fields_are_400_naming_the_field(fields, param):
    error = error_of(parse_completion, body(**fields))
    assert (error.status, error.param) == (400, param)
    assert error.message.startswith(param + ":")
    assert error.body()["error"]["type"] == "invalid_request_error"


def test_model_is_required_and_must_be_the_served_one():
    error = error_of(parse_completion, parse_json_object(b'{"prompt": "x"}'))
    assert (error.status, error.param) == (400, "model")
    error = error_of(check_model, "gpt-4", MODEL)
    assert (error.status, error.param, error.code) == (404, "model", "model_not_found")
    check_model(MODEL, MODEL)


def test_chat_renders_the_tokenizer_template(template, tiny_model_path):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    request = parse_chat(body(messages=messages, max_completion_tokens=9), template)
    expected = load_tokenizer(tiny_model_path).apply_chat_template(messages, add_generation_prompt=True,
                                                                   tokenize=True, return_dict=True)["input_ids"]
    assert list(request.to_router("r").token_ids.ids) == list(expected)
    assert request.sampling.max_tokens == 9
    assert request.params["prompt"] == "messages" and request.params["max_tokens"] == "max_completion_tokens"
    assert request.params["logprobs"] == "top_logprobs"


def test_chat_text_parts_are_joined(template):
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    joined = parse_chat(body(messages=[{"role": "user", "content": parts}]), template)
    plain = parse_chat(body(messages=[{"role": "user", "content": "a\nb"}]), template)
    assert joined.prompt == plain.prompt


@pytest.mark.parametrize("fields, param", [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": ["hi"]}, "messages[0]"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, "tools[0].function"),
    ({"messages": [{"role": "user", "content": "hi"}], "response_format": "json"}, "response_format"),
    ({"messages": [{"role": "user", "content": "hi"}], "prompt": "x"}, "prompt"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": "many"}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5, "max_tokens": "x"}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": 2}, "logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),  # needs logprobs true
    ({"messages": [{"role": "user", "content": "hi"}], "min_p": "low"}, "min_p"),
])
def test_bad_chat_fields_are_400_naming_the_field(template, fields, param):
    error = error_of(parse_chat, body(**fields), template)
    assert (error.status, error.param) == (400, param)


def test_a_tokenizer_without_chat_template_is_a_clear_400():
    class NoTemplate:
        chat_template = None

    error = error_of(parse_chat, body(messages=[{"role": "user", "content": "hi"}]), ChatTemplate(NoTemplate()))
    assert (error.status, error.param) == (400, "messages") and "chat template" in error.message
