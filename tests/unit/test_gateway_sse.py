"""SSE framing and the OpenAI response objects built from router messages."""

from __future__ import annotations

import json

import pytest

from distserve.v1 import common_pb2
from services.router.gateway import responses, sse
from services.router.gateway.errors import ApiError
from services.router.gateway.openai_protocol import Endpoint
from services.router.gateway.responses import AnswerMeta

USAGE = common_pb2.Usage(prompt_tokens=5, completion_tokens=3)


def meta(endpoint: Endpoint, include_usage: bool = False) -> AnswerMeta:
    return AnswerMeta(id="cmpl-abc", created=1700000000, model="m", endpoint=endpoint, include_usage=include_usage)


def test_an_event_is_one_data_line_even_with_newlines_in_the_text():
    raw = sse.event({"text": "a\nb\n\nc", "snowman": "\u2603"})
    assert raw.startswith(b"data: ") and raw.endswith(b"\n\n")
    assert raw.count(b"\n") == 2
    assert json.loads(raw[len(b"data: "):]) == {"text": "a\nb\n\nc", "snowman": "\u2603"}
    assert sse.DONE == b"data: [DONE]\n\n"


def test_parse_events_round_trips_and_rejects_other_lines():
    raw = sse.event({"a": 1}) + sse.event({"b": "x\ny"}) + sse.DONE
    assert sse.parse_events(raw) == ['{"a":1}', '{"b":"x\\ny"}', "[DONE]"]
    with pytest.raises(ValueError):
        sse.parse_events(b"event: ping\n\n")


def test_completion_chunks():
    chunk = responses.text_chunk(meta(Endpoint.COMPLETIONS), "hi", None)
    assert chunk["object"] == "text_completion" and chunk["id"] == "cmpl-abc" and chunk["created"] == 1700000000
    assert chunk["choices"] == [{"index": 0, "text": "hi", "logprobs": None, "finish_reason": None}]
    assert "usage" not in chunk


def test_chat_chunks_start_with_the_role_and_end_with_an_empty_delta():
    m = meta(Endpoint.CHAT, include_usage=True)
    first = responses.role_chunk(m)
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert first["usage"] is None  # as OpenAI sends it when include_usage is set
    assert responses.text_chunk(m, "x", None)["choices"][0]["delta"] == {"content": "x"}
    last = responses.text_chunk(m, "", "stop")["choices"][0]
    assert last["delta"] == {} and last["finish_reason"] == "stop"


def test_usage_chunk_has_no_choices():
    chunk = responses.usage_chunk(meta(Endpoint.CHAT, include_usage=True), USAGE)
    assert chunk["choices"] == []
    assert chunk["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
                              "prompt_tokens_details": {"cached_tokens": 0}}


@pytest.mark.parametrize("endpoint, kind", [(Endpoint.COMPLETIONS, "text_completion"),
                                            (Endpoint.CHAT, "chat.completion")])
def test_full_responses(endpoint, kind):
    body = responses.full_response(meta(endpoint), [responses.whole_choice(meta(endpoint), 0, "hello", "length")],
                                   USAGE)
    assert body["object"] == kind and body["usage"]["total_tokens"] == 8
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length"
    text = choice["message"]["content"] if endpoint == Endpoint.CHAT else choice["text"]
    assert text == "hello"


def test_finish_reasons():
    assert responses.finish_reason(common_pb2.FINISH_REASON_STOP) == "stop"
    assert responses.finish_reason(common_pb2.FINISH_REASON_LENGTH) == "length"
    with pytest.raises(ApiError) as info:  # CANCELLED never reaches a client as a finish reason
        responses.finish_reason(common_pb2.FINISH_REASON_CANCELLED)
    assert info.value.status == 503
    with pytest.raises(ApiError) as info:
        responses.finish_reason(common_pb2.FINISH_REASON_UNSPECIFIED)
    assert info.value.status == 500


def test_an_event_matches_the_standard_librarys_json_for_text_numbers_and_nulls():
    payload = {"text": "\u00e9\t\"q\"\\ \U0001F600", "logprob": -1.25e-05, "top": {"a": -0.5}, "finish": None,
               "ids": [0, 2**31 - 1], "ok": True}
    assert json.loads(sse.event(payload)[len(b"data: "):]) == payload
    assert json.loads(sse.json_text(payload)) == payload


def test_logprobs_the_sampler_masked_out_are_a_finite_number_in_the_answer():
    from services.router.gateway.logprobs_format import LOWEST_LOGPROB, CompletionLogprobs, chat_content

    entry = common_pb2.TokenLogprobs(token_id=1, logprob=-0.1, top_token_ids=[1, 2], top_logprobs=[-0.1, float("-inf")])
    text = {1: "a", 2: "b"}.__getitem__
    chat = chat_content([entry], text)[0]
    assert [top["logprob"] for top in chat["top_logprobs"]][1] == LOWEST_LOGPROB
    legacy = CompletionLogprobs(text).part([entry])
    assert legacy["top_logprobs"][0]["b"] == LOWEST_LOGPROB
    assert "Infinity" not in sse.event({"logprobs": legacy}).decode() and "null" not in sse.event({"c": chat}).decode()
