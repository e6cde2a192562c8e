"""Tools on chat completions: request checks, the grammar that forces calls, and answers shaped as OpenAI's."""

from __future__ import annotations

import asyncio
import json

import pytest

from distserve.engine.structured import json_schema_problem
from distserve.v1 import common_pb2, router_pb2
from services.router.gateway import answers, sse
from services.router.gateway.chat_output import ChatOutput
from services.router.gateway.chat_template import ChatTemplate
from services.router.gateway.errors import ApiError
from services.router.gateway.json_fields import parse_json_object
from services.router.gateway.openai_protocol import Endpoint, parse_chat
from services.router.gateway.reasoning import ReasoningParser
from services.router.gateway.responses import AnswerMeta
from distserve.engine.model_loader import load_tokenizer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                   "required": ["city"]}}}
NOW = {"type": "function", "function": {"name": "now"}}
USER = [{"role": "user", "content": "Weather in Oslo?"}]


@pytest.fixture(scope="module")
def template(tiny_model_path) -> ChatTemplate:
    return ChatTemplate(load_tokenizer(tiny_model_path))


def chat(template, parser="hermes", **fields):
    return parse_chat(parse_json_object(json.dumps({"model": "m", "messages": USER, **fields}).encode()),
                      template, parser)


def param_of(template, parser="hermes", **fields) -> str | None:
    with pytest.raises(ApiError) as info:
        chat(template, parser, **fields)
    assert info.value.status == 400
    return info.value.param


@pytest.mark.parametrize("fields, param", [
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "wat"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "colour": 1}}]}, "tools[0].function.colour"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": [WEATHER] * 129}, "tools"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]}, "messages[0].tool_calls[0]"),
    ({"logit_bias": {"seven": 1}}, "logit_bias"),
    ({"logit_bias": {"7": "high"}}, "logit_bias.7"),
])
def test_bad_tool_fields_are_400_naming_the_field(template, fields, param):
    assert param_of(template, **fields) == param


def test_auto_needs_a_parser_but_none_and_forced_choices_do_not(template):
    assert param_of(template, parser="", tools=[WEATHER]) == "tool_choice"
    assert chat(template, parser="", tools=[WEATHER], tool_choice="none").tools.choice == "none"
    assert chat(template, parser="", tools=[WEATHER], tool_choice="required").tools.forced


def test_a_named_function_forces_its_parameters_schema(template):
    request = chat(template, tools=[NOW, WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    schema = request.sampling.structured_output.json_schema
    assert json.loads(schema) == WEATHER["function"]["parameters"]
    assert request.params["structured_output"] == "tools[1].function.parameters"  # router errors blame the tool


@pytest.mark.parametrize("parallel, max_items", [(True, None), (False, 1)])
def test_required_forces_an_array_of_calls_to_the_given_tools(template, parallel, max_items):
    request = chat(template, tools=[NOW, WEATHER], tool_choice="required", parallel_tool_calls=parallel)
    schema = json.loads(request.sampling.structured_output.json_schema)
    assert schema["minItems"] == 1 and schema.get("maxItems") == max_items
    names = [item["properties"]["name"]["const"] for item in schema["items"]["anyOf"]]
    assert names == ["now", "get_weather"]
    assert json_schema_problem(json.dumps(schema)) == ""


def test_tools_and_earlier_calls_reach_the_chat_template(template):
    messages = USER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12 C"}]
    request = chat(template, tools=[WEATHER], messages=messages)
    text = template.tokenizer.decode(list(request.prompt))
    assert '"name": "get_weather", "description": "Weather in a city"' in text  # the tool, shown to the model
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in text
    assert "<tool_response>\n12 C\n</tool_response>" in text
    assert not request.sampling.HasField("structured_output")  # auto: the model decides


def test_logit_bias_reaches_the_router_request(template):
    assert dict(chat(template, logit_bias={"5": 10, "7": -100}).sampling.logit_bias) == {5: 10.0, 7: -100.0}


class FakeRouterAnswer:
    """The router's messages for one request, as RouterAnswer.next() yields them."""

    def __init__(self, messages: list[router_pb2.GenerateResponse]):
        self._messages = list(messages)

    async def next(self):
        return self._messages.pop(0) if self._messages else None


class FakeResponse:
    def __init__(self):
        self.raw = b""

    async def write(self, data: bytes) -> None:
        self.raw += data


def pieces(texts: list[str], finish=common_pb2.FINISH_REASON_STOP, index: int = 0):
    return [router_pb2.GenerateResponse(text=t, index=index, finish_reason=finish if i == len(texts) - 1 else 0)
            for i, t in enumerate(texts)]


def meta(output) -> AnswerMeta:
    return AnswerMeta(id="chatcmpl-1", created=0, model="m", endpoint=Endpoint.CHAT, chat_output=output)


def hermes_output():
    request = parse_chat(parse_json_object(json.dumps({"model": "m", "messages": USER, "tools": [WEATHER]}).encode()),
                         stub_template(), "hermes")
    return lambda: ChatOutput(None, request.tools.new_parser("hermes"))


def stub_template():
    class Template:  # parse_chat needs only encode and max_context here
        max_context = 0

        def encode(self, messages, kwargs=None, tools=None):
            return [1, 2, 3]
    return Template()


CALL_TEXT = ['Checking.<tool', '_call>\n{"name": "get_weather", "argu', 'ments": {"city": "Oslo"}}\n</tool_call>']


def test_whole_answer_carries_tool_calls_and_finish_reason_tool_calls():
    response = asyncio.run(answers.whole_answer(meta(hermes_output()), FakeRouterAnswer(pieces(CALL_TEXT))))
    choice = json.loads(response.body)["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] == "Checking."
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Oslo"}


def test_a_call_cut_by_max_tokens_is_length_with_the_raw_text_as_content():
    cut = pieces(CALL_TEXT[:2], finish=common_pb2.FINISH_REASON_LENGTH)
    choice = json.loads(asyncio.run(answers.whole_answer(meta(hermes_output()), FakeRouterAnswer(cut))).body)["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["message"] == {"role": "assistant", "content": "".join(CALL_TEXT[:2])}


def test_streamed_calls_come_as_id_and_name_first_then_argument_pieces():
    response = FakeResponse()
    router = FakeRouterAnswer(pieces(CALL_TEXT))
    asyncio.run(answers._write_chunks(response, meta(hermes_output()), router, asyncio.run(router.next())))
    chunks = [json.loads(e) for e in sse.parse_events(response.raw)]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert "".join(d.get("content", "") for d in deltas) == "Checking."
    calls = [call for d in deltas for call in d.get("tool_calls", [])]
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert all("id" not in c and "name" not in c["function"] for c in calls[1:])
    assert json.loads("".join(c["function"]["arguments"] for c in calls)) == {"city": "Oslo"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_content_is_apart_from_content(stream):
    output = meta(lambda: ChatOutput(ReasoningParser("deepseek_r1"), None))
    texts = ["Think", "ing.</th", "ink>\n\nAnswer."]
    if stream:
        response, router = FakeResponse(), FakeRouterAnswer(pieces(texts))
        asyncio.run(answers._write_chunks(response, output, router, asyncio.run(router.next())))
        deltas = [json.loads(e)["choices"][0]["delta"] for e in sse.parse_events(response.raw)]
        reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
        content = "".join(d.get("content", "") for d in deltas)
    else:
        message = json.loads(asyncio.run(answers.whole_answer(output, FakeRouterAnswer(pieces(texts)))).body)[
            "choices"][0]["message"]
        reasoning, content = message["reasoning_content"], message["content"]
    assert (reasoning, content) == ("Thinking.", "\n\nAnswer.")
