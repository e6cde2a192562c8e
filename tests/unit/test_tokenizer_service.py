"""The router's Tokenize/Detokenize work (services.router.tokenizer_service) on the tiny model's tokenizer."""

from __future__ import annotations

import pytest

from distserve.engine.model_loader import load_tokenizer
from distserve.v1 import router_pb2
from services.router.tokenizer_service import detokenize, detokenize_async, tokenize, tokenize_async
from services.router.validation import MAX_CHARS_PER_TOKEN, THREAD_TOKENIZE_CHARS, InvalidRequest

TEXT = "def héllo():\n    return 1 ✓"


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    return load_tokenizer(tiny_model_path)


def test_tokenize_is_the_tokenizer_with_token_strings_when_asked(tokenizer, spec):
    reply = tokenize(router_pb2.TokenizeRequest(text=TEXT), tokenizer, spec)
    assert list(reply.token_ids) == tokenizer(TEXT)["input_ids"]
    assert reply.max_model_len == spec.max_context and not reply.token_strs
    reply = tokenize(router_pb2.TokenizeRequest(text=TEXT, add_special_tokens=False, return_token_strs=True),
                     tokenizer, spec)
    assert list(reply.token_ids) == tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    assert list(reply.token_strs) == tokenizer.convert_ids_to_tokens(list(reply.token_ids))


def test_an_empty_text_is_answered(tokenizer, spec):
    assert list(tokenize(router_pb2.TokenizeRequest(text=""), tokenizer, spec).token_ids) == tokenizer("")["input_ids"]


def test_detokenize_round_trips_and_keeps_special_tokens(tokenizer, spec):
    ids = tokenizer(TEXT)["input_ids"] + [tokenizer.eos_token_id]
    reply = detokenize(router_pb2.DetokenizeRequest(token_ids=ids), tokenizer, spec)
    assert reply.text == TEXT + tokenizer.eos_token


@pytest.mark.parametrize("ids", [[1, -1], [1, 4096], [5] * 2049])
def test_bad_token_ids_name_the_field(tokenizer, spec, ids):
    with pytest.raises(InvalidRequest) as caught:
        detokenize(router_pb2.DetokenizeRequest(token_ids=ids), tokenizer, spec)
    assert caught.value.field == "token_ids"


def test_a_text_that_cannot_fit_is_refused_before_tokenizing(tokenizer, spec):
    text = "x" * (spec.max_context * MAX_CHARS_PER_TOKEN + 1)
    with pytest.raises(InvalidRequest) as caught:
        tokenize(router_pb2.TokenizeRequest(text=text), tokenizer, spec)
    assert caught.value.field == "text" and "at most" in str(caught.value)


async def test_large_inputs_give_the_same_answer_from_the_thread(tokenizer, spec):
    text = "print(1)\n" * (THREAD_TOKENIZE_CHARS // 4)
    reply = await tokenize_async(router_pb2.TokenizeRequest(text=text), tokenizer, spec)
    assert list(reply.token_ids) == tokenizer(text)["input_ids"]
    ids = list(reply.token_ids)[:spec.max_context]
    assert (await detokenize_async(router_pb2.DetokenizeRequest(token_ids=ids), tokenizer, spec)).text == \
        tokenizer.decode(ids)
    with pytest.raises(InvalidRequest):
        await tokenize_async(router_pb2.TokenizeRequest(text="x" * 10**6), tokenizer, spec)
