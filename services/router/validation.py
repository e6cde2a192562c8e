"""Request validation: every bad field is reported by name before any worker is touched."""

from __future__ import annotations

import math

from distserve.convert import sampling_from_proto
from distserve.engine.model_spec import ModelSpec
from distserve.engine.sampling import SamplingParams

MAX_STOP_STRINGS = 16
MAX_REQUEST_ID_LEN = 128


class InvalidRequest(ValueError):
    """A request field is invalid. `field` names it; str() is the message for the client."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


def check(condition: bool, field: str, message: str) -> None:
    if not condition:
        raise InvalidRequest(field, message)


def validate_prompt(tokens: list[int], spec: ModelSpec, field: str = "prompt") -> None:
    check(len(tokens) > 0, field, "must not be empty")
    check(len(tokens) < spec.max_context, field,
          f"{len(tokens)} tokens do not fit the model's context of {spec.max_context} tokens")
    bad = next((t for t in tokens if not 0 <= t < spec.vocab_size), None)
    check(bad is None, field, f"token id {bad} is outside the vocabulary [0, {spec.vocab_size})")


def validate_sampling(params: SamplingParams, prompt_len: int, spec: ModelSpec) -> None:
    check(params.max_tokens > 0, "max_tokens", f"must be > 0, got {params.max_tokens}")
    check(prompt_len + params.max_tokens <= spec.max_context, "max_tokens",
          f"prompt ({prompt_len}) + max_tokens ({params.max_tokens}) exceed the context of {spec.max_context}")
    check(math.isfinite(params.temperature) and params.temperature >= 0, "temperature",
          f"must be >= 0, got {params.temperature}")
    check(math.isfinite(params.top_p) and 0 < params.top_p <= 1, "top_p", f"must be in (0, 1], got {params.top_p}")
    check(params.top_k >= 0, "top_k", f"must be >= 0 (0 disables), got {params.top_k}")
    check(math.isfinite(params.min_p) and 0 <= params.min_p <= 1, "min_p", f"must be in [0, 1], got {params.min_p}")
    check(math.isfinite(params.repetition_penalty) and params.repetition_penalty > 0, "repetition_penalty",
          f"must be > 0 (1 disables), got {params.repetition_penalty}")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(params, name)
        check(math.isfinite(value) and -2 <= value <= 2, name, f"must be in [-2, 2], got {value}")
    check(0 <= params.min_tokens <= params.max_tokens, "min_tokens",
          f"must be in [0, max_tokens], got {params.min_tokens}")
    check(len(params.stop) <= MAX_STOP_STRINGS, "stop", f"at most {MAX_STOP_STRINGS} stop strings")
    check(all(params.stop), "stop", "stop strings must not be empty")
    bad = next((t for t in params.stop_token_ids if not 0 <= t < spec.vocab_size), None)
    check(bad is None, "stop_token_ids", f"token id {bad} is outside the vocabulary [0, {spec.vocab_size})")


def validate_request(request, tokenizer, spec: ModelSpec) -> tuple[list[int], SamplingParams]:
    """GenerateRequest -> (prompt token ids, sampling params), or InvalidRequest."""
    check(len(request.request_id) <= MAX_REQUEST_ID_LEN and request.request_id.isascii()
          and request.request_id.isprintable(), "request_id",
          f"must be printable ASCII and at most {MAX_REQUEST_ID_LEN} characters")
    which = request.WhichOneof("prompt")
    check(which is not None, "prompt", "text or token_ids is required")
    if which == "text":
        check(len(request.text) > 0, "prompt", "must not be empty")
        tokens = tokenizer(request.text)["input_ids"]
    else:
        tokens = list(request.token_ids.ids)
    validate_prompt(tokens, spec)
    params = sampling_from_proto(request.sampling)
    validate_sampling(params, len(tokens), spec)
    return tokens, params
