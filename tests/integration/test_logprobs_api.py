"""Logprobs, prompt logprobs, echo and user through the whole system (gRPC and the openai SDK), against
transformers' log-softmax on the same fp32 model (within 1e-4)."""

from __future__ import annotations

import math

import openai
import pytest
import torch

from distserve.engine.model_loader import load_model, load_tokenizer
from tests.builders import generate, token_request

MODEL = "distserve-tiny"
PROMPT_IDS = [15, 27, 300, 41, 99, 7, 512, 64]
NUM_NEW = 8
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def sdk(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.gateway_url + "/v1", api_key="any-key", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    return load_tokenizer(tiny_model_path)


@pytest.fixture(scope="module")
def reference(tiny_model_path):
    """(greedy completion ids, log-softmax [prompt + completion, V]) from transformers."""
    model = load_model(tiny_model_path, "float32", "cpu")
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT_IDS]), attention_mask=torch.ones(1, len(PROMPT_IDS), dtype=torch.long),
                             max_new_tokens=NUM_NEW, do_sample=False)
        completion = out[0, len(PROMPT_IDS):].tolist()
        logprobs = torch.log_softmax(model(out).logits[0].float(), -1)
    return completion, logprobs


def expected_completion_logprobs(reference) -> list[float]:
    completion, logprobs = reference
    start = len(PROMPT_IDS) - 1  # the row that predicts the first completion token
    return [float(logprobs[start + i, token]) for i, token in enumerate(completion)]


def test_grpc_messages_carry_logprobs_parallel_to_tokens(cluster, reference):
    answer = generate(cluster.router_address, token_request(PROMPT_IDS, max_tokens=NUM_NEW, logprobs=3,
                                                            prompt_logprobs=1, ignore_eos=True))
    completion, logprobs = reference
    assert answer.token_ids == completion
    entries = [e for m in answer.messages for e in m.logprobs]
    assert [e.token_id for e in entries] == completion
    assert [e.logprob for e in entries] == pytest.approx(expected_completion_logprobs(reference), abs=TOLERANCE)
    assert all(e.rank == 1 and len(e.top_token_ids) == 3 and e.top_token_ids[0] == e.token_id for e in entries)
    prompt_entries = answer.messages[0].prompt_logprobs
    assert [e.token_id for e in prompt_entries] == PROMPT_IDS[1:]
    assert [e.logprob for e in prompt_entries] == pytest.approx(
        [float(logprobs[i, PROMPT_IDS[i + 1]]) for i in range(len(PROMPT_IDS) - 1)], abs=TOLERANCE)


def test_no_logprobs_unless_asked_for(cluster):
    answer = generate(cluster.router_address, token_request(PROMPT_IDS, max_tokens=4))
    assert not any(m.logprobs or m.prompt_logprobs for m in answer.messages)


@pytest.mark.parametrize("stream", [False, True])
def test_completions_logprobs_match_the_models_log_softmax(sdk, tokenizer, reference, stream):
    kwargs = dict(model=MODEL, prompt=PROMPT_IDS, max_tokens=NUM_NEW, temperature=0, logprobs=2,
                  extra_body={"ignore_eos": True})
    if stream:
        parts = [c.choices[0].logprobs for c in sdk.completions.create(stream=True, **kwargs) if c.choices]
        token_logprobs = [lp for p in parts if p for lp in p.token_logprobs]
        tokens = [t for p in parts if p for t in p.tokens]
        offsets = [o for p in parts if p for o in p.text_offset]
        top = [t for p in parts if p for t in p.top_logprobs]
    else:
        logprobs = sdk.completions.create(**kwargs).choices[0].logprobs
        token_logprobs, tokens, offsets, top = (logprobs.token_logprobs, logprobs.tokens, logprobs.text_offset,
                                                logprobs.top_logprobs)
    completion, _ = reference
    assert tokens == [tokenizer.decode([t]) for t in completion]
    assert token_logprobs == pytest.approx(expected_completion_logprobs(reference), abs=TOLERANCE)
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    assert all(1 <= len(alternatives) <= 2 and max(alternatives.values()) == pytest.approx(lp, abs=TOLERANCE)
               for alternatives, lp in zip(top, token_logprobs))  # greedy: the chosen token is the top one


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_match_the_models_log_softmax(sdk, tiny_model_path, stream):
    messages = [{"role": "user", "content": "Sort a list."}]
    kwargs = dict(model=MODEL, messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    if stream:
        content = [item for c in sdk.chat.completions.create(stream=True, **kwargs)
                   if c.choices and c.choices[0].logprobs for item in c.choices[0].logprobs.content]
    else:
        content = sdk.chat.completions.create(**kwargs).choices[0].logprobs.content
    tokenizer = load_tokenizer(tiny_model_path)
    prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                return_dict=True)["input_ids"])
    model = load_model(tiny_model_path, "float32", "cpu")
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=6, do_sample=False)
        logprobs = torch.log_softmax(model(out).logits[0].float(), -1)
    completion = out[0, len(prompt):].tolist()
    assert [item.token for item in content] == [tokenizer.decode([t]) for t in completion][:len(content)]
    for i, item in enumerate(content):
        assert item.logprob == pytest.approx(float(logprobs[len(prompt) - 1 + i, completion[i]]), abs=TOLERANCE)
        assert len(item.top_logprobs) == 3 and item.bytes == list(item.token.encode())
        assert [t.logprob for t in item.top_logprobs] == sorted((t.logprob for t in item.top_logprobs), reverse=True)


def test_echo_returns_the_prompt_with_its_logprobs(sdk, tokenizer, reference):
    reply = sdk.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=NUM_NEW, temperature=0, logprobs=1,
                                   echo=True, extra_body={"ignore_eos": True})
    choice = reply.choices[0]
    completion, logprobs = reference
    prompt_text = tokenizer.decode(PROMPT_IDS)
    assert choice.text == prompt_text + tokenizer.decode(completion)
    assert len(choice.logprobs.tokens) == len(PROMPT_IDS) + NUM_NEW
    assert choice.logprobs.token_logprobs[0] is None  # nothing predicts the first prompt token
    assert choice.logprobs.token_logprobs[1] == pytest.approx(float(logprobs[0, PROMPT_IDS[1]]), abs=TOLERANCE)
    assert choice.logprobs.token_logprobs[len(PROMPT_IDS):] == pytest.approx(expected_completion_logprobs(reference),
                                                                             abs=TOLERANCE)
    assert choice.logprobs.text_offset[len(PROMPT_IDS)] == len(prompt_text)


def test_echo_without_logprobs_leads_with_the_prompt_text(sdk):
    plain = sdk.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0).choices[0].text
    echoed = sdk.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text == "Hello" + plain and echoed.choices[0].logprobs is None


def test_prompt_logprobs_in_vllms_shape(sdk, reference):
    reply = sdk.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=2, temperature=0,
                                   extra_body={"prompt_logprobs": 0})
    entries = reply.choices[0].model_extra["prompt_logprobs"]
    _, logprobs = reference
    assert entries[0] is None and len(entries) == len(PROMPT_IDS)
    for i, entry in enumerate(entries[1:]):
        (token, value), = entry.items()
        assert int(token) == PROMPT_IDS[i + 1]
        assert value["logprob"] == pytest.approx(float(logprobs[i, PROMPT_IDS[i + 1]]), abs=TOLERANCE)
        assert value["rank"] >= 1 and math.isfinite(value["logprob"])


@pytest.mark.parametrize("fields, param", [({"logprobs": 21}, "logprobs"), ({"prompt_logprobs": -1}, "prompt_logprobs"),
                                           ({"user": "u" * 300}, "user")])
def test_out_of_range_fields_are_400_naming_them(sdk, fields, param):
    with pytest.raises(openai.BadRequestError) as info:
        sdk.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body=fields)
    assert info.value.body["param"] == param


def test_streamed_echo_leads_with_the_prompt_and_its_logprobs(sdk, tokenizer, reference):
    chunks = [c.choices[0] for c in sdk.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=NUM_NEW,
                                                           temperature=0, logprobs=0, echo=True, stream=True,
                                                           extra_body={"ignore_eos": True}) if c.choices]
    completion, _ = reference
    assert "".join(c.text for c in chunks) == tokenizer.decode(PROMPT_IDS) + tokenizer.decode(completion)
    token_logprobs = [lp for c in chunks if c.logprobs for lp in c.logprobs.token_logprobs]
    assert token_logprobs[0] is None and len(token_logprobs) == len(PROMPT_IDS) + NUM_NEW


def test_user_reaches_the_router_span(cluster, otlp_receiver, sdk):
    sdk.completions.create(model=MODEL, prompt="x", max_tokens=2, user="alice-42",
                           extra_headers={"X-Request-Id": "user-field-test"})
    span = otlp_receiver.wait_for_span("user-field-test", "router.generate")
    assert span.attributes["user.id"] == "alice-42"


def test_a_refused_request_has_its_reason_on_the_router_span(cluster, otlp_receiver, sdk):
    with pytest.raises(openai.BadRequestError):
        sdk.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={"logprobs": 99},
                               extra_headers={"X-Request-Id": "refusal-reason-test"})
    span = otlp_receiver.wait_for_span("refusal-reason-test", "router.generate")
    assert span.attributes["distserve.error.code"] == "INVALID_ARGUMENT"
    assert span.attributes["distserve.error.message"].startswith("logprobs: must be in [0, 20]")
