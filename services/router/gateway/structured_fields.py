"""`response_format` (OpenAI) and `structured_outputs` (vLLM's extra) -> the router's StructuredOutput.

Only shapes are checked here; whether a schema, regex or grammar compiles is the router's to say
(it owns the grammar compiler), and its "structured_output: ..." errors name the client's field.

- response_format: {"type": "text"} | {"type": "json_object"} |
  {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}
- structured_outputs: exactly one of {"json": schema object or JSON text, "json_object": true,
  "regex": str, "choice": [str, ...], "grammar": EBNF str}
"""

from __future__ import annotations

import json
from typing import Any

from distserve.v1 import common_pb2
from services.router.gateway.errors import bad_request
from services.router.gateway.json_fields import Body, show

STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


def structured_output(body: Body) -> tuple[common_pb2.StructuredOutput | None, str]:
    """The request's grammar (None: unconstrained) and the client field that carried it."""
    response_format = body.get_object("response_format")
    extras = body.get_object("structured_outputs")
    if response_format is not None and extras is not None and response_format.get("type") not in (None, "text"):
        raise bad_request("structured_outputs", "give either response_format or structured_outputs, not both")
    if extras is not None:
        return _from_structured_outputs(extras), "structured_outputs"
    if response_format is not None:
        return _from_response_format(response_format), "response_format"
    return None, ""


def _from_response_format(value: dict[str, Any]) -> common_pb2.StructuredOutput | None:
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return common_pb2.StructuredOutput(json_object=True)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise bad_request("response_format.json_schema", f"must be an object, got {show(spec)}")
        schema = spec.get("schema", {})  # OpenAI allows a schema-less json_schema: any JSON
        if not isinstance(schema, dict):
            raise bad_request("response_format.json_schema.schema", f"must be an object, got {show(schema)}")
        return common_pb2.StructuredOutput(json_schema=json.dumps(schema))
    raise bad_request("response_format.type", f"must be text, json_object or json_schema; got {show(kind)}")


def _from_structured_outputs(value: dict[str, Any]) -> common_pb2.StructuredOutput | None:
    given = {k: v for k, v in value.items() if v is not None and k in STRUCTURED_KINDS}
    unknown = [k for k in value if k not in STRUCTURED_KINDS and k not in ("disable_any_whitespace",
                                                                           "disable_fallback",
                                                                           "disable_additional_properties",
                                                                           "whitespace_pattern")]
    if unknown:
        raise bad_request(f"structured_outputs.{unknown[0]}", "unrecognized structured output option")
    if len(given) != 1:
        raise bad_request("structured_outputs", f"give exactly one of {', '.join(STRUCTURED_KINDS)}; "
                                                f"got {', '.join(given) or 'none'}")
    (kind, item), = given.items()
    where = f"structured_outputs.{kind}"
    if kind == "json":
        if isinstance(item, str):
            return common_pb2.StructuredOutput(json_schema=item)
        if not isinstance(item, dict):
            raise bad_request(where, f"must be a JSON schema object or its JSON text, got {show(item)}")
        return common_pb2.StructuredOutput(json_schema=json.dumps(item))
    if kind == "json_object":
        if item is not True:
            raise bad_request(where, f"must be true, got {show(item)}")
        return common_pb2.StructuredOutput(json_object=True)
    if kind == "choice":
        if not isinstance(item, list) or not item or not all(isinstance(c, str) and c for c in item):
            raise bad_request(where, f"must be a non-empty array of non-empty strings, got {show(item)}")
        return common_pb2.StructuredOutput(choice=common_pb2.StringList(values=item))
    if not isinstance(item, str) or not item:
        raise bad_request(where, f"must be a non-empty string, got {show(item)}")
    return common_pb2.StructuredOutput(**{kind: item})
