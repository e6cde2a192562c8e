"""Gateway error mapping: router gRPC status -> HTTP status and OpenAI error object; JSON body checks."""

from __future__ import annotations

import grpc
import pytest

from services.router.gateway.errors import ApiError, bad_request, from_router_error
from services.router.gateway.json_fields import parse_json_object

CHAT_PARAMS = {"prompt": "messages", "max_tokens": "max_completion_tokens"}


def test_error_body_is_the_openai_error_object():
    error = bad_request("temperature", "must be >= 0")
    assert error.body() == {"error": {"message": "temperature: must be >= 0", "type": "invalid_request_error",
                                      "param": "temperature", "code": "invalid_value"}}
    assert error.headers() == {}


@pytest.mark.parametrize("details, params, param, message", [
    ("temperature: must be >= 0, got -1.0", {}, "temperature", "temperature: must be >= 0, got -1.0"),
    ("prompt: 3000 tokens do not fit the model's context of 2048 tokens", CHAT_PARAMS, "messages",
     "messages: 3000 tokens do not fit the model's context of 2048 tokens"),
    ("max_tokens: must be > 0, got 0", CHAT_PARAMS, "max_completion_tokens",
     "max_completion_tokens: must be > 0, got 0"),
    ("prompt: must not be empty", {"prompt": "prompt"}, "prompt", "prompt: must not be empty"),
    ("prefill worker prefill-1: shape mismatch", {}, None, "prefill worker prefill-1: shape mismatch"),
])
def test_invalid_argument_is_400_with_the_clients_field_name(details, params, param, message):
    error = from_router_error(grpc.StatusCode.INVALID_ARGUMENT, details, params, retry_after_s=1)
    assert (error.status, error.param, error.message, error.type) == (400, param, message, "invalid_request_error")


def test_resource_exhausted_is_429_with_retry_after():
    error = from_router_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "decode worker d: no 95 free KV blocks in time",
                              {}, retry_after_s=3)
    assert (error.status, error.type, error.code) == (429, "rate_limit_error", "rate_limit_exceeded")
    assert error.headers() == {"Retry-After": "3"}
    assert "no 95 free KV blocks" in error.message


def test_a_request_over_the_routers_message_cap_is_413_not_a_retry():
    error = from_router_error(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              "Received message larger than max (5000043 vs. 4194304)", {}, retry_after_s=3)
    assert (error.status, error.code, error.headers()) == (413, "request_too_large", {})


@pytest.mark.parametrize("code, status", [
    (grpc.StatusCode.UNAVAILABLE, 503),  # no workers, or the router unreachable
    (grpc.StatusCode.CANCELLED, 503),
    (grpc.StatusCode.DEADLINE_EXCEEDED, 504),
    (grpc.StatusCode.INTERNAL, 500),
    (grpc.StatusCode.UNKNOWN, 500),
])
def test_other_router_failures(code, status):
    error = from_router_error(code, "details", {}, retry_after_s=1)
    assert error.status == status
    assert error.type == "server_error" and error.param is None
    assert error.headers() == {}


@pytest.mark.parametrize("raw, fragment", [
    (b"\xff\xfe{}", "not valid UTF-8"),
    (b'{"model": "m",', "not valid JSON"),
    (b"", "not valid JSON"),
    (b'{"temperature": NaN}', "not valid JSON"),
    (b'[1, 2]', "must be a JSON object"),
])
def test_unreadable_bodies_are_400_without_param(raw, fragment):
    with pytest.raises(ApiError) as info:
        parse_json_object(raw)
    assert (info.value.status, info.value.param) == (400, None)
    assert fragment in info.value.message


@pytest.mark.parametrize("value", ["1e999", "-1e999", "1" + "0" * 400])
def test_numbers_beyond_float_range_are_400(value):
    body = parse_json_object(b'{"temperature": ' + value.encode() + b"}")
    with pytest.raises(ApiError) as info:
        body.get_number("temperature")
    assert (info.value.status, info.value.param) == (400, "temperature")


def test_null_reads_as_absent():
    body = parse_json_object(b'{"temperature": null, "stop": null}')
    assert body.get_number("temperature") is None and body.get_str_list("stop") is None
    assert not body.has("temperature")
