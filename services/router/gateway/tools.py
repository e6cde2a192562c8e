"""`tools`, `tool_choice` and `parallel_tool_calls` on chat completions: checked, and turned into what
the rest of the request needs (the chat template's tools, a grammar, a parser).

- tool_choice "none": the template sees the tools; the answer is plain content.
- "auto" (the default with tools): the model decides; a parser for the model's format reads calls out
  of its text (tool_parsers). Needs one: --tool-call-parser, or a chat template that shows its format.
- "required", or a named function: a grammar forces the output to be calls, whatever the model. The
  grammar is a JSON schema, compiled by the router like any structured output: for a named function,
  its parameters schema (the whole output is the arguments); for "required", an array of
  `{"name": <one of the tools>, "arguments": <its parameters>}` (one item when parallel_tool_calls is
  false). Calls parse and validate against the tool's schema, unless cut off by max_tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from typing import Any

from distserve.v1 import common_pb2
from services.router.gateway import tool_parsers
from services.router.gateway.errors import bad_request
from services.router.gateway.json_fields import Body, show

MAX_TOOLS = 128  # OpenAI's limit
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
_CHOICES = ("none", "auto", "required")
_FUNCTION_KEYS = {"name", "description", "parameters", "strict"}
# A chat template's own text tells which format it teaches the model.
_TEMPLATE_FORMATS = (("<tool_call>", "hermes"), ("[TOOL_CALLS]", "mistral"), ("<|python_tag|>", "llama3_json"))


@dataclasses.dataclass(frozen=True)
class ToolsRequest:
    """A request's checked tools and how they may be called."""

    tools: tuple[dict[str, Any], ...]  # {"type": "function", "function": {...}}, as chat templates take them
    choice: str  # none | auto | required | function
    function: str = ""  # the function a named tool_choice forces
    parallel: bool = True

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "function")

    def grammar(self) -> tuple[common_pb2.StructuredOutput, str] | None:
        """The grammar that forces calls and the client field a bad schema is blamed on; None unless forced."""
        if self.choice == "function":
            index = next(i for i, t in enumerate(self.tools) if t["function"]["name"] == self.function)
            schema = _parameters(self.tools[index])
            return (common_pb2.StructuredOutput(json_schema=json.dumps(schema)),
                    f"tools[{index}].function.parameters")
        if self.choice == "required":
            calls = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                       "arguments": _parameters(t)},
                      "required": ["name", "arguments"], "additionalProperties": False} for t in self.tools]
            schema = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
            if not self.parallel:
                schema["maxItems"] = 1
            return common_pb2.StructuredOutput(json_schema=json.dumps(schema)), "tools"
        return None

    def new_parser(self, auto_parser: str) -> tool_parsers.ToolCallParser | None:
        """A parser for one choice's text; None when the answer is plain content."""
        if self.choice == "function":
            return tool_parsers.NamedCall(self.function)
        if self.choice == "required":
            return tool_parsers.array_of_calls()
        if self.choice == "auto":
            return tool_parsers.PARSERS[auto_parser]()
        return None


def parse_tools(body: Body, auto_parser: str) -> ToolsRequest | None:
    """The request's tools (None: it has none); 400s name the field. `auto_parser` is the gateway's parser
    for tool_choice "auto" ("" when it has none)."""
    tools = body.get_list("tools") or []
    if len(tools) > MAX_TOOLS:
        raise bad_request("tools", f"at most {MAX_TOOLS} tools, got {len(tools)}")
    checked = tuple(_tool(i, tool) for i, tool in enumerate(tools))
    _check_unique_names(checked)
    parallel = body.get_bool("parallel_tool_calls")
    choice, function = _tool_choice(body.raw("tool_choice"), checked)
    if not checked:
        return None
    if choice == "auto" and not auto_parser:
        raise bad_request("tool_choice", '"auto" needs a tool-call parser, and this server has none for its '
                                         'model: start the gateway with --tool-call-parser (hermes, llama3_json, '
                                         'mistral), or send tool_choice "required", "none" or a named function')
    for i, tool in enumerate(checked):
        _check_schema(f"tools[{i}].function.parameters", json.dumps(_parameters(tool), sort_keys=True))
    return ToolsRequest(checked, choice, function, parallel is not False)


def parser_for_template(template_text: str) -> str:
    """The tool-call format a chat template teaches ("" when it shows none)."""
    return next((name for marker, name in _TEMPLATE_FORMATS if marker in template_text), "")


def _tool(index: int, tool: Any) -> dict[str, Any]:
    where = f"tools[{index}]"
    if not isinstance(tool, dict):
        raise bad_request(where, f"must be an object, got {show(tool)}")
    if tool.get("type") != "function":
        raise bad_request(f"{where}.type", f'must be "function", got {show(tool.get("type"))}')
    function = tool.get("function")
    if not isinstance(function, dict):
        raise bad_request(f"{where}.function", f"must be an object, got {show(function)}")
    unknown = sorted(set(function) - _FUNCTION_KEYS)
    if unknown:
        raise bad_request(f"{where}.function.{unknown[0]}", "unrecognized function field")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise bad_request(f"{where}.function.name", f"must be 1 to 64 letters, digits, _ or -; got {show(name)}")
    if function.get("description") is not None and not isinstance(function["description"], str):
        raise bad_request(f"{where}.function.description", f"must be a string, got {show(function['description'])}")
    if function.get("parameters") is not None and not isinstance(function["parameters"], dict):
        raise bad_request(f"{where}.function.parameters", f"must be a JSON schema object, got "
                                                          f"{show(function['parameters'])}")
    if function.get("strict") is not None and not isinstance(function["strict"], bool):
        raise bad_request(f"{where}.function.strict", f"must be a boolean, got {show(function['strict'])}")
    return {"type": "function", "function": {k: v for k, v in function.items() if v is not None}}


def _check_unique_names(tools: tuple[dict[str, Any], ...]) -> None:
    seen: dict[str, int] = {}
    for i, tool in enumerate(tools):
        name = tool["function"]["name"]
        if name in seen:
            raise bad_request(f"tools[{i}].function.name", f"{name!r} is already the name of tools[{seen[name]}]")
        seen[name] = i


def _tool_choice(value: Any, tools: tuple[dict[str, Any], ...]) -> tuple[str, str]:
    """(none | auto | required | function, the named function)."""
    if value is None:
        return ("auto" if tools else "none"), ""
    if isinstance(value, str):
        if value not in _CHOICES:
            raise bad_request("tool_choice", f"must be none, auto, required or a function; got {show(value)}")
        if value == "required" and not tools:
            raise bad_request("tool_choice", '"required" needs tools')
        return value, ""
    if not isinstance(value, dict) or value.get("type") != "function" or not isinstance(value.get("function"), dict):
        raise bad_request("tool_choice", 'must be a string or {"type": "function", "function": {"name": ...}}, '
                                         f"got {show(value)}")
    name = value["function"].get("name")
    if name not in {t["function"]["name"] for t in tools}:
        raise bad_request("tool_choice.function.name", f"{show(name)} is not the name of any of the tools")
    return "function", name


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or {"type": "object"}


@functools.lru_cache(maxsize=1024)
def _check_schema(where: str, schema: str) -> None:
    """400 naming `where` when xgrammar cannot turn the schema into a grammar (cached: agents resend the
    same tools with every turn)."""
    from distserve.engine.structured import json_schema_problem  # xgrammar: loaded by the first tools

    error = json_schema_problem(schema)
    if error:
        raise bad_request(where, f"is not a usable JSON schema: {error}")
