"""validate_request: each bad field is reported by name; a good request comes back with defaults."""

from __future__ import annotations

import math
import threading

import pytest

from distserve.request_types import SamplingParams
from distserve.v1 import router_pb2
from services.router.validation import (
    MAX_CHARS_PER_TOKEN,
    MAX_LOGIT_BIAS,
    MAX_REQUEST_ID_LEN,
    MAX_STOP_STRING_BYTES,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    THREAD_TOKENIZE_CHARS,
    InvalidRequest,
    validate_request,
    validate_request_async,
)
from tests.builders import model_spec, sampling, token_request

SPEC = model_spec(vocab_size=256, max_context=64)
LONG_SPEC = model_spec(vocab_size=256, max_context=1024)  # room for prompts past THREAD_TOKENIZE_CHARS


def char_tokenizer(text: str) -> dict:
    """One token per character, its code point (so chars past U+00FF are outside SPEC's vocabulary)."""
    return {"input_ids": [ord(c) for c in text]}


def text_request(text: str, **kwargs) -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(text=text, sampling=sampling(**kwargs))


def validate(request):
    return validate_request(request, char_tokenizer, SPEC)


def _resumed(request, token_ids: list[int], n: int = 0):
    request.resume_token_ids.extend(token_ids)
    request.n = n
    return request


BAD_REQUESTS = {
    "request-id-too-long": (router_pb2.GenerateRequest(request_id="r" * (MAX_REQUEST_ID_LEN + 1),
                                                       text="hi"), "request_id"),
    "request-id-not-printable": (router_pb2.GenerateRequest(request_id="a\nb", text="hi"), "request_id"),
    "missing-prompt": (router_pb2.GenerateRequest(sampling=sampling()), "prompt"),
    "empty-text": (text_request(""), "prompt"),
    "empty-token-ids": (token_request([]), "prompt"),
    "prompt-fills-context": (token_request([5] * SPEC.max_context, max_tokens=1), "prompt"),
    "text-too-long": (text_request("a" * SPEC.max_context, max_tokens=1), "prompt"),
    "token-id-at-vocab-size": (token_request([5, SPEC.vocab_size]), "prompt"),
    "negative-token-id": (token_request([-1, 5]), "prompt"),
    "text-outside-vocab": (text_request("h\u0394"), "prompt"),
    "max-tokens-zero": (token_request([5], max_tokens=0), "max_tokens"),
    "max-tokens-negative": (token_request([5], max_tokens=-3), "max_tokens"),
    "prompt-plus-max-tokens-over-context": (token_request([5] * 60, max_tokens=5), "max_tokens"),
    "temperature-negative": (token_request([5], temperature=-0.5), "temperature"),
    "temperature-nan": (token_request([5], temperature=math.nan), "temperature"),
    "temperature-inf": (token_request([5], temperature=math.inf), "temperature"),
    "top-p-zero": (token_request([5], top_p=0.0), "top_p"),
    "top-p-above-one": (token_request([5], top_p=1.5), "top_p"),
    "top-p-nan": (token_request([5], top_p=math.nan), "top_p"),
    "top-k-negative": (token_request([5], top_k=-1), "top_k"),
    "min-p-negative": (token_request([5], min_p=-0.1), "min_p"),
    "min-p-above-one": (token_request([5], min_p=1.5), "min_p"),
    "min-p-nan": (token_request([5], min_p=math.nan), "min_p"),
    "repetition-penalty-zero": (token_request([5], repetition_penalty=0.0), "repetition_penalty"),
    "repetition-penalty-negative": (token_request([5], repetition_penalty=-1.0), "repetition_penalty"),
    "repetition-penalty-inf": (token_request([5], repetition_penalty=math.inf), "repetition_penalty"),
    "repetition-penalty-nan": (token_request([5], repetition_penalty=math.nan), "repetition_penalty"),
    "presence-penalty-above-two": (token_request([5], presence_penalty=2.5), "presence_penalty"),
    "presence-penalty-below-minus-two": (token_request([5], presence_penalty=-2.5), "presence_penalty"),
    "presence-penalty-nan": (token_request([5], presence_penalty=math.nan), "presence_penalty"),
    "frequency-penalty-above-two": (token_request([5], frequency_penalty=3.0), "frequency_penalty"),
    "frequency-penalty-below-minus-two": (token_request([5], frequency_penalty=-2.1), "frequency_penalty"),
    "frequency-penalty-inf": (token_request([5], frequency_penalty=-math.inf), "frequency_penalty"),
    "min-tokens-over-max-tokens": (token_request([5], max_tokens=4, min_tokens=5), "min_tokens"),
    "min-tokens-negative": (token_request([5], min_tokens=-1), "min_tokens"),
    "empty-stop-string": (token_request([5], stop=["ok", ""]), "stop"),
    "too-many-stop-strings": (token_request([5], stop=[f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]), "stop"),
    "stop-token-id-at-vocab-size": (token_request([5], stop_token_ids=[SPEC.vocab_size]), "stop_token_ids"),
    "negative-stop-token-id": (token_request([5], stop_token_ids=[3, -2]), "stop_token_ids"),
    "stop-string-too-long": (token_request([5], stop=["\u00e9" * (MAX_STOP_STRING_BYTES // 2 + 1)]), "stop"),
    "too-many-stop-token-ids": (token_request([5], stop_token_ids=[1] * (MAX_STOP_TOKEN_IDS + 1)), "stop_token_ids"),
    "huge-token-id-list": (token_request([5] * 1_000_000), "prompt"),
    "text-longer-than-any-tokenization": (text_request("a" * (SPEC.max_context * MAX_CHARS_PER_TOKEN + 1)), "prompt"),
    "cache-salt-with-a-space": (token_request([5], cache_salt="a b"), "cache_salt"),
    "cache-salt-too-long": (token_request([5], cache_salt="a" * 129), "cache_salt"),
    "logit-bias-too-many": (token_request([5], logit_bias={t: 1.0 for t in range(MAX_LOGIT_BIAS + 1)}), "logit_bias"),
    "logit-bias-above-100": (token_request([5], logit_bias={3: 101.0}), "logit_bias"),
    "logit-bias-below-minus-100": (token_request([5], logit_bias={3: -101.0}), "logit_bias"),
    "logit-bias-nan": (token_request([5], logit_bias={3: math.nan}), "logit_bias"),
    "logit-bias-inf": (token_request([5], logit_bias={3: math.inf}), "logit_bias"),
    "logit-bias-id-at-vocab-size": (token_request([5], logit_bias={SPEC.vocab_size: 1.0}), "logit_bias"),
    "logit-bias-negative-id": (token_request([5], logit_bias={-1: 1.0}), "logit_bias"),
    "resume-with-n-2": (_resumed(token_request([5], max_tokens=8), [3], n=2), "resume_token_ids"),
    "resume-past-max-tokens": (_resumed(token_request([5], max_tokens=2), [3, 4]), "resume_token_ids"),
    "resume-id-at-vocab-size": (_resumed(token_request([5]), [SPEC.vocab_size]), "resume_token_ids"),
}


def test_a_cache_salt_of_the_allowed_characters_passes():
    _, params = validate(token_request([5], cache_salt="Tenant_1.prod:eu-" + "x" * 111))
    assert len(params.cache_salt) == 128


@pytest.mark.parametrize("request_, field", BAD_REQUESTS.values(), ids=BAD_REQUESTS.keys())
def test_bad_field_is_named(request_, field):
    with pytest.raises(InvalidRequest) as exc:
        validate(request_)
    assert exc.value.field == field
    assert str(exc.value).startswith(f"{field}: ")


def test_text_prompt_is_tokenized_and_params_read():
    tokens, params = validate(text_request("hello", max_tokens=5, temperature=0.5, top_p=0.5, top_k=3, seed=9,
                                           stop=["\n"], stop_token_ids=[7], ignore_eos=True, min_tokens=2))
    assert tokens == [ord(c) for c in "hello"]
    assert params == SamplingParams(max_tokens=5, temperature=0.5, top_p=0.5, top_k=3, seed=9, stop=("\n",),
                                    stop_token_ids=(7,), ignore_eos=True, min_tokens=2)


def test_sampler_fields_are_read_and_their_limits_are_inclusive():
    _, params = validate(token_request([5], temperature=0.5, repetition_penalty=1.25, presence_penalty=-0.5,
                                       frequency_penalty=0.75, min_p=0.125))
    assert params == SamplingParams(max_tokens=16, temperature=0.5, repetition_penalty=1.25, presence_penalty=-0.5,
                                    frequency_penalty=0.75, min_p=0.125)
    assert params.has_penalties
    _, params = validate(token_request([5], presence_penalty=2.0, frequency_penalty=-2.0, min_p=1.0))
    assert (params.presence_penalty, params.frequency_penalty, params.min_p) == (2.0, -2.0, 1.0)
    _, params = validate(token_request([5], presence_penalty=-2.0, frequency_penalty=2.0, min_p=0.0,
                                       repetition_penalty=1e-3))
    assert (params.presence_penalty, params.frequency_penalty, params.min_p) == (-2.0, 2.0, 0.0)
    assert params.repetition_penalty > 0


def test_unset_optional_fields_take_the_defaults():
    request = router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=[5, 6]))
    tokens, params = validate(request)
    assert tokens == [5, 6]
    assert params == SamplingParams()
    assert params.seed is None and params.temperature == 1.0 and params.top_p == 1.0 and params.max_tokens == 16
    assert (params.repetition_penalty, params.presence_penalty, params.frequency_penalty, params.min_p) == (1, 0, 0, 0)
    assert not params.has_penalties


def test_the_context_limits_are_inclusive_where_they_fit():
    tokens, params = validate(token_request([5] * (SPEC.max_context - 1), max_tokens=1))
    assert len(tokens) == SPEC.max_context - 1 and params.max_tokens == 1
    _, params = validate(token_request([5] * 60, max_tokens=4, min_tokens=4, top_p=1.0, top_k=0))
    assert (params.max_tokens, params.min_tokens) == (4, 4)


def test_longest_allowed_request_id_passes():
    tokens, _ = validate(router_pb2.GenerateRequest(request_id="r" * MAX_REQUEST_ID_LEN, text="ok"))
    assert tokens == [ord("o"), ord("k")]


def test_stop_limits_are_inclusive():
    _, params = validate(token_request([5], stop=["\u00e9" * (MAX_STOP_STRING_BYTES // 2)] * MAX_STOP_STRINGS,
                                       stop_token_ids=[1] * MAX_STOP_TOKEN_IDS))
    assert len(params.stop) == MAX_STOP_STRINGS and len(params.stop_token_ids) == MAX_STOP_TOKEN_IDS


def test_logit_bias_limits_are_inclusive_and_messages_name_the_bad_entry():
    spec = model_spec(vocab_size=32000, max_context=64)
    bias = {t: (100.0 if t % 2 else -100.0) for t in range(spec.vocab_size - MAX_LOGIT_BIAS, spec.vocab_size)}
    _, params = validate_request(token_request([5], logit_bias=bias), char_tokenizer, spec)
    assert params.logit_bias == tuple(sorted(bias.items())) and params.has_logit_bias
    with pytest.raises(InvalidRequest, match=r"^logit_bias: token id 99999 is outside the vocabulary \[0, 256\)$"):
        validate(token_request([5], logit_bias={99999: 1.0}))
    with pytest.raises(InvalidRequest, match=r"^logit_bias: the bias of token 3 must be in \[-100, 100\], got 101"):
        validate(token_request([5], logit_bias={2: 0.0, 3: 101.0}))


def test_oversized_text_is_refused_before_tokenizing():
    def tokenizer_must_not_run(text: str) -> dict:
        raise AssertionError("tokenized a prompt that was too long to fit")

    request = text_request("a" * (SPEC.max_context * MAX_CHARS_PER_TOKEN + 1))
    with pytest.raises(InvalidRequest, match="^prompt: .*characters cannot fit"):
        validate_request(request, tokenizer_must_not_run, SPEC)


def _thread_recording_tokenizer(threads: list[str]):
    def tokenize(text: str) -> dict:
        threads.append(threading.current_thread().name)
        return {"input_ids": [ord(c) % SPEC.vocab_size for c in text[:10]]}

    return tokenize


async def test_async_validation_tokenizes_large_prompts_off_the_event_loop():
    threads: list[str] = []
    tokenizer = _thread_recording_tokenizer(threads)
    small = await validate_request_async(text_request("hello", max_tokens=5), tokenizer, LONG_SPEC)
    large = await validate_request_async(text_request("x" * (THREAD_TOKENIZE_CHARS + 1), max_tokens=5),
                                         tokenizer, LONG_SPEC)
    main = threading.current_thread().name
    assert threads[0] == main and threads[1] != main
    assert small[0] == [ord(c) for c in "hello"] and len(large[0]) == 10


async def test_async_validation_names_the_bad_field():
    with pytest.raises(InvalidRequest) as exc:
        await validate_request_async(text_request("y" * (THREAD_TOKENIZE_CHARS + 1), temperature=-1.0),
                                     _thread_recording_tokenizer([]), LONG_SPEC)
    assert exc.value.field == "temperature"
