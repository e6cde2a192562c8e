"""Tool calling and reasoning through the whole system, driven by the official openai SDK.

The default models' chat template is Hermes-style, so the shared cluster's gateway reads tool_choice
"auto" calls with its hermes parser. Their weights are random: where a test needs the model to write a
call (or to think), a grammar makes it, and what is checked is what the server makes of that text.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
import urllib.request

import openai
import pytest

from distserve.ports import free_port

MODEL = "distserve-tiny"
USER = [{"role": "user", "content": "What is the weather in Oslo?"}]
WEATHER_PARAMETERS = {"type": "object",
                      "properties": {"city": {"enum": ["Oslo", "Paris"]}, "days": {"enum": [1, 2, 3]}},
                      "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The forecast for a city",
                                           "parameters": WEATHER_PARAMETERS}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
             "additionalProperties": False}}}]
HERMES_REGEX = (r'Looking it up\.\n<tool_call>\n\{"name": "get_weather", "arguments": '
                r'\{"city": "(Oslo|Paris)", "days": [123]\}\}\n</tool_call>\n'
                r'<tool_call>\n\{"name": "get_time", "arguments": \{"zone": "(UTC|CET)"\}\}\n</tool_call>')


@pytest.fixture(scope="module")
def sdk(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.gateway_url + "/v1", api_key="any-key", max_retries=0)


def check_call(call) -> dict:
    """A call's arguments, checked against its tool's schema (enums, required, no others)."""
    assert call.type == "function" and call.id.startswith("call_")
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[call.function.name]
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == set(schema["required"])
    for key, value in arguments.items():
        assert value in schema["properties"][key]["enum"]
    return arguments


def streamed(chunks) -> dict[int, dict]:
    """Per choice: content, finish_reason and the calls, put together from their streamed pieces."""
    choices: dict[int, dict] = {}
    for chunk in chunks:
        for c in chunk.choices:
            state = choices.setdefault(c.index, {"content": "", "finish": None, "calls": {}})
            state["content"] += c.delta.content or ""
            state["finish"] = c.finish_reason or state["finish"]
            for piece in c.delta.tool_calls or []:
                if piece.id is not None:
                    assert piece.index not in state["calls"], "a call's id and name come in its first piece"
                    state["calls"][piece.index] = {"id": piece.id, "name": piece.function.name, "arguments": ""}
                state["calls"][piece.index]["arguments"] += piece.function.arguments or ""
    return choices


def as_call(state: dict):
    return openai.types.chat.ChatCompletionMessageToolCall(
        id=state["id"], type="function", function={"name": state["name"], "arguments": state["arguments"]})


@pytest.mark.parametrize("stream", [False, True])
def test_required_returns_valid_calls_for_every_choice(sdk, stream):
    args = dict(model=MODEL, messages=USER, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, n=2,
                temperature=1.0, seed=7, max_tokens=64)
    if stream:
        choices = streamed(sdk.chat.completions.create(stream=True, **args))
        results = [(s["finish"], s["content"] or None, [as_call(c) for c in s["calls"].values()])
                   for _, s in sorted(choices.items())]
    else:
        results = [(c.finish_reason, c.message.content, c.message.tool_calls)
                   for c in sdk.chat.completions.create(**args).choices]
    assert len(results) == 2
    for finish, content, calls in results:
        assert finish == "tool_calls" and content is None and len(calls) == 1
        check_call(calls[0])


def test_required_streamed_equals_whole_for_greedy(sdk):
    # one call: with parallel calls allowed, random weights keep adding calls until max_tokens
    args = dict(model=MODEL, messages=USER, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                temperature=0, max_tokens=96)
    whole = sdk.chat.completions.create(**args).choices[0]
    (state,) = streamed(sdk.chat.completions.create(stream=True, **args)).values()
    assert state["finish"] == whole.finish_reason == "tool_calls"
    calls = [as_call(c) for _, c in sorted(state["calls"].items())]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        (c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls]
    for call in calls:
        check_call(call)


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_function_is_called_with_valid_arguments(sdk, stream):
    args = dict(model=MODEL, messages=USER, tools=TOOLS, n=2, temperature=1.0, seed=3, max_tokens=64,
                tool_choice={"type": "function", "function": {"name": "get_weather"}})
    if stream:
        choices = streamed(sdk.chat.completions.create(stream=True, **args))
        results = [(s["finish"], [as_call(c) for c in s["calls"].values()]) for _, s in sorted(choices.items())]
    else:
        results = [(c.finish_reason, c.message.tool_calls) for c in sdk.chat.completions.create(**args).choices]
    assert len(results) == 2
    for finish, calls in results:
        assert finish == "tool_calls" and [c.function.name for c in calls] == ["get_weather"]
        check_call(calls[0])


def test_two_turns_call_then_tool_result_then_answer(sdk):
    first = sdk.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, temperature=0, max_tokens=64,
                                        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    messages = USER + [first.choices[0].message.model_dump(exclude_none=True),
                       {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"}]
    second = sdk.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="none",
                                         temperature=0, max_tokens=8)
    assert second.choices[0].finish_reason in ("stop", "length")
    assert second.choices[0].message.tool_calls is None and second.choices[0].message.content
    # the call and the tool's result are in the second prompt, after the first one
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + first.usage.completion_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_auto_parses_hermes_text_into_tool_calls(sdk, stream):
    args = dict(model=MODEL, messages=USER, tools=TOOLS, temperature=0, max_tokens=300,
                extra_body={"structured_outputs": {"regex": HERMES_REGEX}})
    if stream:
        (state,) = streamed(sdk.chat.completions.create(stream=True, **args)).values()
        finish, content, calls = state["finish"], state["content"], [as_call(c) for c in state["calls"].values()]
    else:
        choice = sdk.chat.completions.create(**args).choices[0]
        finish, content, calls = choice.finish_reason, choice.message.content, choice.message.tool_calls
    assert finish == "tool_calls" and content == "Looking it up.\n"
    assert [c.function.name for c in calls] == ["get_weather", "get_time"]  # parallel calls, in order
    for call in calls:
        check_call(call)


def test_a_call_cut_by_max_tokens_is_length_and_its_text_is_content(sdk):
    args = dict(model=MODEL, messages=USER, tools=TOOLS, temperature=0, max_tokens=4,
                tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = sdk.chat.completions.create(**args).choices[0]
    assert choice.finish_reason == "length" and choice.message.tool_calls is None
    assert choice.message.content and choice.message.content.startswith('{"')  # the arguments, unfinished
    (state,) = streamed(sdk.chat.completions.create(stream=True, **args)).values()
    assert state["finish"] == "length"  # streamed, the pieces already sent stand; their JSON is unfinished
    assert state["calls"][0]["name"] == "get_weather" and choice.message.content == state["calls"][0]["arguments"]


@pytest.mark.parametrize("fields, param", [
    ({"tools": TOOLS + TOOLS[:1]}, "tools[2].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "wat"}}}]},
     "tools[0].function.parameters"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
])
def test_bad_tool_definitions_are_400_naming_the_field(sdk, fields, param):
    with pytest.raises(openai.BadRequestError) as info:
        sdk.chat.completions.create(model=MODEL, messages=USER, max_tokens=4, **fields)
    assert info.value.status_code == 400 and info.value.body["param"] == param


def test_logit_bias_steers_every_token(sdk, tiny_model_path):
    reply = sdk.completions.create(model=MODEL, prompt="def f(", max_tokens=5, temperature=0,
                                   logit_bias={"42": 100}, extra_body={"ignore_eos": True, "return_token_ids": True})
    assert reply.choices[0].model_extra["token_ids"] == [42] * 5


@contextlib.contextmanager
def gateway(cluster, tiny_model_path, *flags: str):
    """A second gateway on the shared cluster's router, with other flags."""
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "services.router.gateway", "--port", str(port),
                                "--model", str(tiny_model_path), "--router-address", cluster.router_address, *flags])
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/version", timeout=1).close()
                break
            except OSError:
                assert process.poll() is None and time.monotonic() < deadline, "the gateway did not start"
                time.sleep(0.2)
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="any-key", max_retries=0)
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_reasoning_content_is_split_from_content_streamed_and_whole(cluster, tiny_model_path):
    args = dict(model=MODEL, messages=USER, temperature=0, max_tokens=60,
                extra_body={"structured_outputs": {"regex": r"<think>[a-z]{1,8}</think>\n\n[A-Z][a-z]{1,8}\."}})
    with gateway(cluster, tiny_model_path, "--reasoning-parser", "qwen3") as sdk:
        whole = sdk.chat.completions.create(**args).choices[0].message
        chunks = list(sdk.chat.completions.create(stream=True, **args))
    reasoning, content = whole.model_extra["reasoning_content"], whole.content
    assert reasoning.isalpha() and reasoning.islower() and content.startswith("\n\n") and content.endswith(".")
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == reasoning
    assert "".join(d.content or "" for d in deltas) == content
