"""Tool-call and reasoning parsers: the same answer whether the text comes whole or split at any point."""

from __future__ import annotations

import json

import pytest

from services.router.gateway import tool_parsers
from services.router.gateway.call_scanner import CallScanner
from services.router.gateway.reasoning import ReasoningParser


def run(parser: tool_parsers.ToolCallParser, pieces: list[str]) -> tuple[str, dict[int, dict]]:
    """Feeds pieces; returns the content and, per call index, the streamed name and joined arguments."""
    out = tool_parsers.Parsed()
    for piece in pieces:
        out += parser.feed(piece)
    out += parser.finish()
    calls: dict[int, dict] = {}
    for delta in out.calls:
        if delta.id is not None:
            assert delta.index not in calls, "a call's id and name come once"
            calls[delta.index] = {"id": delta.id, "name": delta.name, "arguments": delta.arguments}
        else:
            assert delta.index in calls, "argument pieces come after the call's name"
            calls[delta.index]["arguments"] += delta.arguments
    return out.content, calls


def splits(text: str):
    """The text whole, in two pieces at every point, and one character at a time."""
    yield [text]
    for cut in range(1, len(text)):
        yield [text[:cut], text[cut:]]
    yield list(text)


HERMES = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris, \\"FR\\"", '
          '"days": [1, {"x": "}"}]}}\n</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>')


@pytest.mark.parametrize("pieces", list(splits(HERMES)))
def test_hermes_every_split_gives_the_same_calls(pieces):
    parser = tool_parsers.hermes()
    content, calls = run(parser, pieces)
    assert content == "Let me look.\n"
    assert [c["name"] for c in calls.values()] == ["get_weather", "now"]
    assert json.loads(calls[0]["arguments"]) == {"city": 'Paris, "FR"', "days": [1, {"x": "}"}]}
    assert json.loads(calls[1]["arguments"]) == {}
    whole = parser.calls()
    assert [(c.name, json.loads(c.arguments)) for c in whole] == [
        ("get_weather", {"city": 'Paris, "FR"', "days": [1, {"x": "}"}]}), ("now", {})]
    assert [c.id for c in whole] == [calls[0]["id"], calls[1]["id"]]


def test_hermes_plain_text_and_lookalike_tags_stay_content():
    text = "a < b, <tool and <tool_call> not json </tool_call> end"
    for pieces in splits(text):
        parser = tool_parsers.hermes()
        content, calls = run(parser, pieces)
        assert (content, calls) == (text, {}), pieces
        assert parser.calls() == []


def test_hermes_call_cut_off_is_incomplete():
    parser = tool_parsers.hermes()
    _, calls = run(parser, ['<tool_call>\n{"name": "f", "arguments": {"a": "unfinis'])
    assert calls[0]["name"] == "f" and calls[0]["arguments"] == '{"a": "unfinis'
    assert parser.calls() is None  # the answer falls back to the raw text


def test_hermes_arguments_as_a_json_string_are_unquoted():
    parser = tool_parsers.hermes()
    _, calls = run(parser, ['<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'])
    assert json.loads(calls[0]["arguments"]) == {"a": 1}
    assert parser.calls()[0].arguments == '{"a": 1}'


LLAMA = '{"name": "search", "parameters": {"q": "a;b"}}; {"name": "now", "parameters": {}}'


@pytest.mark.parametrize("pieces", list(splits(LLAMA)))
def test_llama3_json_calls_joined_by_semicolons(pieces):
    parser = tool_parsers.llama3_json()
    content, calls = run(parser, pieces)
    assert content == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [("search", {"q": "a;b"}),
                                                                                 ("now", {})]


def test_llama3_json_plain_answers_and_json_that_is_no_call_are_content():
    for text in ("Hello {there}", '{"answer": 42}', "  "):
        parser = tool_parsers.llama3_json()
        assert run(parser, list(text)) == (text, {})


MISTRAL = '[TOOL_CALLS][{"name": "a", "arguments": {"x": [1, 2]}}, {"name": "b", "arguments": {}}]'


@pytest.mark.parametrize("text", [MISTRAL, MISTRAL[len("[TOOL_CALLS]"):]])
def test_mistral_array_with_or_without_its_marker(text):
    for pieces in splits(text):
        parser = tool_parsers.mistral()
        content, calls = run(parser, pieces)
        assert content == ""
        assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [("a", {"x": [1, 2]}),
                                                                                     ("b", {})]


def test_array_parser_leaves_a_non_call_array_as_content():
    for text in ("[1, 2]", "[] ok", "[x"):
        assert run(tool_parsers.array_of_calls(), list(text)) == (text, {})


def test_named_call_streams_the_whole_text_as_arguments():
    parser = tool_parsers.NamedCall("get_weather")
    content, calls = run(parser, ['{"ci', 'ty": "Oslo"}'])
    assert content == "" and calls[0]["name"] == "get_weather"
    assert json.loads(calls[0]["arguments"]) == {"city": "Oslo"}
    assert parser.calls()[0].name == "get_weather"
    cut = tool_parsers.NamedCall("f")
    run(cut, ['{"city": "Os'])
    assert cut.calls() is None


def test_scanner_reports_name_before_arguments_even_when_written_after():
    scanner = CallScanner()
    scanner.feed('{"arguments": {"a": 1}, ')
    assert scanner.take() == (None, "")
    scanner.feed('"name": "f"}')
    assert scanner.take() == ("f", '{"a": 1}') and scanner.done


@pytest.mark.parametrize("kind,text,expected", [
    ("deepseek_r1", "thinking hard</think>\n\nThe answer.", ("thinking hard", "\n\nThe answer.")),
    ("deepseek_r1", "<think>x</think>y", ("x", "y")),
    ("deepseek_r1", "never closes", ("never closes", "")),
    ("qwen3", "<think>\nplan\n</think>\n\nDone.", ("\nplan\n", "\n\nDone.")),
    ("qwen3", "No thinking here </think>", ("", "No thinking here </think>")),
    ("qwen3", "<thi", ("", "<thi")),
])
def test_reasoning_split_at_every_point(kind, text, expected):
    for pieces in splits(text):
        parser = ReasoningParser(kind)
        reasoning = content = ""
        for piece in pieces:
            r, c = parser.feed(piece)
            reasoning, content = reasoning + r, content + c
        r, c = parser.finish()
        assert (reasoning + r, content + c) == expected, pieces


def test_named_call_cut_inside_a_string_adds_nothing_at_the_end():
    parser = tool_parsers.NamedCall("f")
    _, calls = run(parser, ['{"city'])
    assert calls[0]["arguments"] == '{"city' and parser.calls() is None
