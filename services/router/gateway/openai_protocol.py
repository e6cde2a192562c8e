"""OpenAI request bodies -> router GenerateRequest: every field type-checked, every bad field named.

Ranges (temperature >= 0, the prompt fits the context, ...) are the router's to
check, so they are checked once; its "<field>: <message>" errors are mapped
back through `ApiRequest.params`. What the gateway checks is what the wire
cannot carry or the router cannot know: JSON types, int32/uint64 limits, n,
stream_options, batched prompts, chat messages, tools (services.router.gateway.tools),
and unsupported OpenAI features (accepted only at their "off" value, e.g. functions []).

The field tables below are the one place that says which fields each endpoint takes.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Callable, Mapping
from typing import Any

from distserve.v1 import common_pb2, router_pb2
from services.router.gateway.chat_template import ChatTemplate, chat_template_kwargs
from services.router.gateway.errors import ApiError, bad_request
from services.router.gateway.json_fields import INT32_MAX, INT32_MIN, Body, check_int_list, is_number, show
from services.router.gateway.structured_fields import structured_output
from services.router.gateway.tools import ToolsRequest, parse_tools
from services.router.validation import MAX_CHARS_PER_TOKEN


class Endpoint(enum.Enum):
    COMPLETIONS = "completions"
    CHAT = "chat"


@dataclasses.dataclass(frozen=True)
class ApiRequest:
    """A type-checked OpenAI request, ready to send to the router."""

    endpoint: Endpoint
    model: str
    stream: bool
    include_usage: bool
    prompt: str | tuple[int, ...]  # text (the router tokenizes) or token ids
    sampling: common_pb2.SamplingParams
    params: Mapping[str, str]  # router request field -> the client's field, for error messages
    n: int = 1
    best_of: int = 0  # 0: n
    echo: bool = False
    user: str = ""
    return_token_ids: bool = False  # completions: each choice also carries its token ids (vLLM's extra)
    tools: ToolsRequest | None = None  # chat: the tools the model may call

    @property
    def wants_logprobs(self) -> bool:
        return self.sampling.HasField("logprobs")

    def to_router(self, request_id: str) -> router_pb2.GenerateRequest:
        request = router_pb2.GenerateRequest(request_id=request_id, sampling=self.sampling, n=self.n,
                                             best_of=self.best_of, echo=self.echo, user=self.user)
        if isinstance(self.prompt, str):
            request.text = self.prompt
        else:
            request.token_ids.ids.extend(self.prompt)
        return request


# Accepted, type-checked and ignored: they do not change the answer.
_IGNORED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "metadata": (lambda v: isinstance(v, dict), "an object"),
    "store": (lambda v: isinstance(v, bool), "a boolean"),
    "service_tier": (lambda v: isinstance(v, str), "a string"),
    "safety_identifier": (lambda v: isinstance(v, str), "a string"),
    "prompt_cache_key": (lambda v: isinstance(v, str), "a string"),
}
# Features this server does not implement: accepted only at the value that turns them off.
# null is always accepted; off values compare by type too, so logprobs 0 (chosen-token logprobs) is not false.
_OFF_ONLY: dict[str, tuple[Callable[[Any], bool], str, tuple[Any, ...]]] = {
    "suffix": (lambda v: isinstance(v, str), "a string", ("",)),
    "functions": (lambda v: isinstance(v, list), "an array (deprecated by OpenAI: send tools)", ([],)),
    "function_call": (lambda v: isinstance(v, (str, dict)), "a string or an object (deprecated by OpenAI: "
                                                            "send tool_choice)", ("none", "auto")),
    "modalities": (lambda v: isinstance(v, list), "an array", (["text"],)),
}
# Numbers copied, when given, to the SamplingParams field of the same name; the router checks their ranges.
_NUMBERS = ("temperature", "top_p", "presence_penalty", "frequency_penalty",  # OpenAI's
            "repetition_penalty", "min_p")  # vLLM's extras
_SAMPLING = {"model", "stream", "stream_options", "max_tokens", "seed", "stop", "n", *_NUMBERS,
             "top_k", "ignore_eos", "stop_token_ids", "min_tokens"}  # top_k and below: vLLM's extras
_COMMON = _SAMPLING | set(_IGNORED) | {"logit_bias", "logprobs", "user", "response_format", "structured_outputs",
                                       "prompt_logprobs", "cache_salt"}  # the last three: vLLM's extras
COMPLETION_FIELDS = frozenset(_COMMON | {"prompt", "best_of", "echo", "suffix", "return_token_ids"})  # vLLM's
CHAT_FIELDS = frozenset(_COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools",
                                   "functions", "tool_choice", "parallel_tool_calls", "function_call", "modalities",
                                   "chat_template_kwargs"})  # the last: vLLM's extra
_ROLES = ("system", "developer", "user", "assistant", "tool")


def requested_model(body: Body) -> str:
    model = body.get_str("model")
    if not model:
        raise bad_request("model", "is required")
    return model


def check_model(model: str, served_model_name: str) -> None:
    """404 unless `model` is the one this gateway serves."""
    if model != served_model_name:
        raise ApiError(404, f"The model `{model}` does not exist; this server serves `{served_model_name}`",
                       param="model", code="model_not_found")


def parse_completion(body: Body) -> ApiRequest:
    """POST /v1/completions body -> ApiRequest (prompt as text or token ids)."""
    request = _parse_common(body, Endpoint.COMPLETIONS, COMPLETION_FIELDS, "max_tokens")
    logprobs = body.get_int("logprobs")  # legacy completions: how many alternatives (0: the chosen token only)
    echo = bool(body.get_bool("echo"))
    if logprobs is not None:
        request.sampling.logprobs = logprobs
        if echo and not request.sampling.HasField("prompt_logprobs"):
            request.sampling.prompt_logprobs = logprobs  # echoed prompt tokens carry logprobs too
    best_of = body.get_int("best_of") or 0
    if request.stream and best_of > request.n:
        raise bad_request("best_of", "cannot be streamed: best_of > n picks the best only once all are done")
    return dataclasses.replace(request, prompt=_completion_prompt(body), best_of=best_of, echo=echo,
                               return_token_ids=bool(body.get_bool("return_token_ids")))


def parse_chat(body: Body, template: ChatTemplate, tool_call_parser: str = "") -> ApiRequest:
    """POST /v1/chat/completions body -> ApiRequest; the chat template turns messages (and tools) into token
    ids. `tool_call_parser`: the format tool_choice "auto" reads calls in ("": none)."""
    max_tokens_field = "max_completion_tokens" if body.has("max_completion_tokens") else "max_tokens"
    body.get_int("max_tokens")  # type-checked even when max_completion_tokens (the newer name) wins
    request = _parse_common(body, Endpoint.CHAT, CHAT_FIELDS, max_tokens_field)
    _chat_logprobs(body, request.sampling)
    tools = parse_tools(body, tool_call_parser)
    params = _force_tool_calls(tools, request.sampling, request.params)
    messages = [chat_message(i, m) for i, m in enumerate(_required_list(body, "messages"))]
    _check_chat_fits(messages, template.max_context)
    prompt = tuple(template.encode(messages, chat_template_kwargs(body.raw("chat_template_kwargs")),
                                   tools=list(tools.tools) if tools else None))
    if not request.sampling.HasField("max_tokens") and 0 < len(prompt) < template.max_context:
        # OpenAI's chat default is no limit: answer up to the end of the model's context.
        request.sampling.max_tokens = template.max_context - len(prompt)
    return dataclasses.replace(request, prompt=prompt, tools=tools, params=params)


def _force_tool_calls(tools: ToolsRequest | None, sampling: common_pb2.SamplingParams,
                      params: Mapping[str, str]) -> Mapping[str, str]:
    """tool_choice "required" or a named function: the calls' grammar becomes the request's structured
    output, and a schema the router cannot compile is blamed on the tool that holds it."""
    forced = tools.grammar() if tools is not None else None
    if forced is None:
        return params
    if sampling.HasField("structured_output"):
        raise bad_request("tool_choice", f"{show(tools.choice)} forces tool calls, which cannot be combined with "
                                         f"{params['structured_output']}")
    grammar, field = forced
    sampling.structured_output.CopyFrom(grammar)
    return {**params, "structured_output": field}


def _chat_logprobs(body: Body, sampling: common_pb2.SamplingParams) -> None:
    """Chat spells logprobs as `logprobs: true` plus `top_logprobs: N` alternatives."""
    wanted, top = body.get_bool("logprobs"), body.get_int("top_logprobs")
    if top is not None and not wanted:
        raise bad_request("top_logprobs", "requires logprobs to be true")
    if wanted:
        sampling.logprobs = top or 0


def _check_chat_fits(messages: list[dict[str, Any]], max_context: int) -> None:
    """Refuses, before templating and tokenizing them, messages too long for any tokenization to fit."""
    num_chars = sum(len(m["content"]) + sum(len(str(c["function"]["arguments"])) for c in m.get("tool_calls", ()))
                    for m in messages)
    max_chars = max_context * MAX_CHARS_PER_TOKEN
    if max_context and num_chars > max_chars:
        raise bad_request("messages", f"{num_chars} characters of content cannot fit the model's context of "
                                      f"{max_context} tokens (at most {max_chars} characters)")


def _parse_common(body: Body, endpoint: Endpoint, allowed: frozenset[str], max_tokens_field: str) -> ApiRequest:
    _check_field_names(body, allowed)
    n = body.get_int("n")
    if n is not None and n < 1:
        raise bad_request("n", f"must be >= 1, got {n}")
    stream = bool(body.get_bool("stream"))
    options = body.get_object("stream_options")
    if options is not None and not stream:
        raise bad_request("stream_options", "is only allowed when stream is true")
    prompt_field = "messages" if endpoint == Endpoint.CHAT else "prompt"
    sampling = _sampling(body, max_tokens_field)
    _logit_bias(body, sampling)
    structured, structured_field = structured_output(body)
    if structured is not None:
        sampling.structured_output.CopyFrom(structured)
    return ApiRequest(endpoint=endpoint, model=requested_model(body), stream=stream,
                      include_usage=_include_usage(options or {}), prompt=(), sampling=sampling,
                      params={"prompt": prompt_field, "max_tokens": max_tokens_field,
                              "structured_output": structured_field or "structured_outputs",
                              "logprobs": "top_logprobs" if endpoint == Endpoint.CHAT else "logprobs"},
                      n=n or 1, user=body.get_str("user") or "")


def _check_field_names(body: Body, allowed: frozenset[str]) -> None:
    for name in body.names():
        value = body.raw(name)
        if name not in allowed:
            raise bad_request(name, "unrecognized request argument")
        if value is None:
            continue
        if name in _IGNORED and not _IGNORED[name][0](value):
            raise bad_request(name, f"must be {_IGNORED[name][1]}, got {show(value)}")
        if name in _OFF_ONLY:
            is_type, type_name, off = _OFF_ONLY[name]
            if not is_type(value):
                raise bad_request(name, f"must be {type_name}, got {show(value)}")
            if not any(type(value) is type(o) and value == o for o in off):
                raise bad_request(name, f"{show(value)} is not supported by this server (only {show(off[0])})")


def _include_usage(options: dict[str, Any]) -> bool:
    for key, value in options.items():
        if key not in ("include_usage", "include_obfuscation"):
            raise bad_request(f"stream_options.{key}", "unrecognized stream option")
        if value is not None and not isinstance(value, bool):
            raise bad_request(f"stream_options.{key}", f"must be a boolean, got {show(value)}")
    return bool(options.get("include_usage"))


def _sampling(body: Body, max_tokens_field: str) -> common_pb2.SamplingParams:
    """Only fields the client gave are set, so the router applies its defaults (max_tokens 16, temperature 1)."""
    top_k = body.get_int("top_k")
    sampling = common_pb2.SamplingParams(
        top_k=0 if top_k == -1 else top_k or 0,  # vLLM spells "no top-k" as -1
        stop=body.get_str_list("stop") or [],
        stop_token_ids=body.get_int_list("stop_token_ids") or [],
        ignore_eos=bool(body.get_bool("ignore_eos")),
        min_tokens=body.get_int("min_tokens") or 0,
        cache_salt=body.get_str("cache_salt") or "",
    )
    max_tokens = body.get_int(max_tokens_field)
    if max_tokens is not None:
        sampling.max_tokens = max_tokens
    for name in _NUMBERS:
        value = body.get_number(name)
        if value is not None:
            setattr(sampling, name, value)
    prompt_logprobs = body.get_int("prompt_logprobs")
    if prompt_logprobs is not None:
        sampling.prompt_logprobs = prompt_logprobs
    seed = body.get_int("seed", lo=-(2**63), hi=2**64 - 1)
    if seed is not None:
        sampling.seed = seed % 2**64  # negative seeds (int64) are accepted, as by OpenAI
    return sampling


def _logit_bias(body: Body, sampling: common_pb2.SamplingParams) -> None:
    """logit_bias {"<token id>": bias}: JSON object keys are strings, so each must spell an integer; the
    router checks the ids, values and count."""
    value = body.get_object("logit_bias") or {}
    for key, bias in value.items():
        try:
            token_id = int(key)
        except ValueError:
            raise bad_request("logit_bias", f"keys must be token ids, got {show(key)}") from None
        if not INT32_MIN <= token_id <= INT32_MAX:
            raise bad_request("logit_bias", f"token id {key} is out of range")
        if not is_number(bias):
            raise bad_request(f"logit_bias.{key}", f"must be a number, got {show(bias)}")
        sampling.logit_bias[token_id] = float(bias)


def _completion_prompt(body: Body) -> str | tuple[int, ...]:
    value = body.raw("prompt")
    if value is None:
        raise bad_request("prompt", "is required")
    if isinstance(value, list) and value and isinstance(value[0], (str, list)):
        if len(value) > 1:
            raise bad_request("prompt", f"batched prompts ({len(value)}) are not supported; send one per request")
        value = value[0]
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise bad_request("prompt", f"must be a string or an array of token ids, got {show(value)}")
    if not value:
        raise bad_request("prompt", "must not be empty")
    check_int_list("prompt", value)
    return tuple(value)


def _required_list(body: Body, name: str) -> list[Any]:
    value = body.get_list(name)
    if not value:
        raise bad_request(name, "is required and must not be empty")
    return value


def chat_message(index: int, message: Any) -> dict[str, Any]:
    """One chat message -> {"role", "content"} with the content as plain text, plus what tool use adds:
    an assistant's `tool_calls` (arguments as objects, the way chat templates print them), a tool
    message's `tool_call_id`, and a `name`."""
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise bad_request(where, f"must be an object, got {show(message)}")
    role = message.get("role")
    if role not in _ROLES:
        raise bad_request(f"{where}.role", f"must be one of {', '.join(_ROLES)}; got {show(role)}")
    content = message.get("content")
    if content is None and role == "assistant":  # an assistant turn that only called tools
        content = ""
    checked: dict[str, Any] = {"role": role, "content": _content_text(f"{where}.content", content)}
    for key in ("name", "tool_call_id"):
        if message.get(key) is not None:
            if not isinstance(message[key], str):
                raise bad_request(f"{where}.{key}", f"must be a string, got {show(message[key])}")
            checked[key] = message[key]
    if message.get("tool_calls") and role == "assistant":
        checked["tool_calls"] = _tool_calls(f"{where}.tool_calls", message["tool_calls"])
    return checked


def _tool_calls(where: str, calls: Any) -> list[dict[str, Any]]:
    """An assistant message's earlier tool calls, for the chat template."""
    if not isinstance(calls, list):
        raise bad_request(where, f"must be an array, got {show(calls)}")
    checked = []
    for i, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad_request(f"{where}[{i}]", 'must be {"id": ..., "type": "function", "function": {"name": ..., '
                                               f'"arguments": ...}}}}, got {show(call)}')
        arguments = function.get("arguments", "{}")
        if not isinstance(arguments, (str, dict)):
            raise bad_request(f"{where}[{i}].function.arguments", f"must be a JSON string, got {show(arguments)}")
        checked.append({"id": str(call.get("id") or ""), "type": "function",
                        "function": {"name": function["name"], "arguments": _as_object(arguments)}})
    return checked


def _as_object(arguments: str | dict) -> Any:
    """Arguments JSON text -> the object it spells (what templates' `tojson` expects); other text as is."""
    if isinstance(arguments, dict):
        return arguments
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments


def _content_text(where: str, content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(where, f"must be a string or an array of content parts, got {show(content)}")
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise bad_request(f"{where}[{i}]", f"only text parts {{\"type\": \"text\", \"text\": ...}} are "
                                               f"supported, got {show(part)}")
        texts.append(part["text"])
    return "\n".join(texts)
