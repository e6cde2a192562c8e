"""Request validation: every bad field is reported by name before any worker is touched.

Sizes are bounded before any work scales with them: stop strings, stop token ids
and the prompt text's length are checked before the prompt is tokenized, so a
hostile request costs at most one bounded tokenization. `validate_request_async`
is the entry point for servers: it tokenizes large prompts in a thread, so other
requests' streams on the same event loop keep flowing.
"""

from __future__ import annotations

import asyncio
import math
import re
from collections.abc import Sequence

from distserve.convert import sampling_from_proto
from distserve.request_types import MAX_LOGPROBS
from distserve.model_spec import ModelSpec
from distserve.request_types import SamplingParams

MAX_CACHE_SALT = 128
CACHE_SALT_CHARS = re.compile(r"[A-Za-z0-9_.:-]*")

MAX_STOP_STRINGS = 16  # OpenAI allows 4; vLLM sets no limit
MAX_STOP_STRING_BYTES = 1024  # UTF-8 bytes of one stop string (text is held back while it may match one)
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 300  # entries, as OpenAI allows
MAX_LOGIT_BIAS_VALUE = 100.0  # |bias| at most, as OpenAI allows
MAX_REQUEST_ID_LEN = 128
MAX_USER_LEN = 256
MAX_COMPLETIONS = 16  # n and best_of
# A prompt text longer than max_context * this many characters cannot fit the context (no tokenizer has
# tokens that long), so it is refused before tokenizing it.
MAX_CHARS_PER_TOKEN = 64
# Prompt texts longer than this are tokenized in a thread (the tokenizer releases the GIL).
THREAD_TOKENIZE_CHARS = 4096


class InvalidRequest(ValueError):
    """A request field is invalid. `field` names it; str() is the message for the client."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


def prompt_size_problem(prompt: str | Sequence[int], max_context: int) -> str:
    """Why a prompt (text, or token ids) cannot fit the context, before tokenizing it; "" when it may. The
    gateway asks too, so that what it accepts never outgrows the router's message cap."""
    if isinstance(prompt, str):
        max_chars = max_context * MAX_CHARS_PER_TOKEN
        if not prompt:
            return "must not be empty"
        if len(prompt) > max_chars:
            return (f"{len(prompt)} characters cannot fit the model's context of {max_context} tokens "
                    f"(at most {max_chars} characters)")
        return ""
    if len(prompt) >= max_context:
        return f"{len(prompt)} tokens do not fit the model's context of {max_context} tokens"
    return ""


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
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        check(value is None or 0 <= value <= MAX_LOGPROBS, name, f"must be in [0, {MAX_LOGPROBS}], got {value}")
    check(len(params.cache_salt) <= MAX_CACHE_SALT and CACHE_SALT_CHARS.fullmatch(params.cache_salt) is not None,
          "cache_salt", f"must be at most {MAX_CACHE_SALT} characters of [A-Za-z0-9_.:-]")
    validate_stops(params, spec)
    validate_logit_bias(params, spec)


def validate_stops(params: SamplingParams, spec: ModelSpec) -> None:
    """Stop strings and stop token ids: bounded in number and size, none empty, ids in the vocabulary."""
    check(len(params.stop) <= MAX_STOP_STRINGS, "stop",
          f"at most {MAX_STOP_STRINGS} stop strings, got {len(params.stop)}")
    check(all(params.stop), "stop", "stop strings must not be empty")
    longest = max((len(s.encode()) for s in params.stop), default=0)
    check(longest <= MAX_STOP_STRING_BYTES, "stop",
          f"each stop string must be at most {MAX_STOP_STRING_BYTES} bytes, got one of {longest}")
    check(len(params.stop_token_ids) <= MAX_STOP_TOKEN_IDS, "stop_token_ids",
          f"at most {MAX_STOP_TOKEN_IDS} stop token ids, got {len(params.stop_token_ids)}")
    bad = next((t for t in params.stop_token_ids if not 0 <= t < spec.vocab_size), None)
    check(bad is None, "stop_token_ids", f"token id {bad} is outside the vocabulary [0, {spec.vocab_size})")


def validate_logit_bias(params: SamplingParams, spec: ModelSpec) -> None:
    """logit_bias: at most MAX_LOGIT_BIAS entries, each id in the vocabulary (the engine indexes its logits
    with them) and each value finite and within +-MAX_LOGIT_BIAS_VALUE."""
    bias = params.logit_bias
    check(len(bias) <= MAX_LOGIT_BIAS, "logit_bias", f"at most {MAX_LOGIT_BIAS} entries, got {len(bias)}")
    bad = next((t for t, _ in bias if not 0 <= t < spec.vocab_size), None)
    check(bad is None, "logit_bias", f"token id {bad} is outside the vocabulary [0, {spec.vocab_size})")
    limit = MAX_LOGIT_BIAS_VALUE
    token, value = next(((t, v) for t, v in bias if not (math.isfinite(v) and -limit <= v <= limit)), (None, None))
    check(token is None, "logit_bias", f"the bias of token {token} must be in [-{limit:g}, {limit:g}], got {value}")


def validate_request(request, tokenizer, spec: ModelSpec) -> tuple[list[int], SamplingParams]:
    """GenerateRequest -> (prompt token ids, sampling params), or InvalidRequest. Tokenizes on the caller's
    thread: servers on an event loop call `validate_request_async`."""
    params = _validate_before_tokenizing(request, spec)
    tokens = _prompt_tokens(request, tokenizer)
    validate_prompt(tokens, spec)
    validate_sampling(params, len(tokens), spec)
    return tokens, params


async def validate_request_async(request, tokenizer, spec: ModelSpec) -> tuple[list[int], SamplingParams]:
    """validate_request, with a prompt text over THREAD_TOKENIZE_CHARS tokenized in a worker thread.

    Everything bounded and cheap is checked first on the loop, so an oversized or malformed request is
    refused without a thread hop."""
    _validate_before_tokenizing(request, spec)
    if request.WhichOneof("prompt") == "text" and len(request.text) > THREAD_TOKENIZE_CHARS:
        return await asyncio.to_thread(validate_request, request, tokenizer, spec)
    return validate_request(request, tokenizer, spec)


def _validate_before_tokenizing(request, spec: ModelSpec) -> SamplingParams:
    """The checks whose cost does not grow with the prompt; returns the sampling params."""
    check(len(request.request_id) <= MAX_REQUEST_ID_LEN and request.request_id.isascii()
          and request.request_id.isprintable(), "request_id",
          f"must be printable ASCII and at most {MAX_REQUEST_ID_LEN} characters")
    check(len(request.user) <= MAX_USER_LEN, "user", f"must be at most {MAX_USER_LEN} characters")
    check(0 <= request.n <= MAX_COMPLETIONS, "n", f"must be in [1, {MAX_COMPLETIONS}], got {request.n}")
    check(request.best_of == 0 or max(request.n, 1) <= request.best_of <= MAX_COMPLETIONS, "best_of",
          f"must be in [n, {MAX_COMPLETIONS}], got {request.best_of}")
    which = request.WhichOneof("prompt")
    check(which is not None, "prompt", "text or token_ids is required")
    problem = prompt_size_problem(request.text if which == "text" else request.token_ids.ids, spec.max_context)
    check(not problem, "prompt", problem)
    try:
        params = sampling_from_proto(request.sampling)
    except ValueError as exc:  # structured.InvalidGrammar: a malformed structured_output
        raise InvalidRequest("structured_output", str(exc)) from None
    validate_stops(params, spec)
    validate_logit_bias(params, spec)
    validate_resume(request, params, spec)
    return params


def validate_resume(request, params: SamplingParams, spec: ModelSpec) -> None:
    """resume_token_ids: one completion's tokens so far, fewer than max_tokens, each in the vocabulary."""
    resumed = request.resume_token_ids
    if not resumed:
        return
    check(request.n <= 1 and request.best_of <= 1, "resume_token_ids", "needs n and best_of of 1")
    check(len(resumed) < params.max_tokens, "resume_token_ids",
          f"{len(resumed)} tokens leave nothing to generate within max_tokens ({params.max_tokens})")
    bad = next((t for t in resumed if not 0 <= t < spec.vocab_size), None)
    check(bad is None, "resume_token_ids", f"token id {bad} is outside the vocabulary [0, {spec.vocab_size})")


def _prompt_tokens(request, tokenizer) -> list[int]:
    if request.WhichOneof("prompt") == "text":
        return list(tokenizer(request.text)["input_ids"])
    return list(request.token_ids.ids)
