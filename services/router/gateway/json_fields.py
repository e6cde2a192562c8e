"""Typed reads of one JSON request body: a field of the wrong type is a 400 naming it.

This is the HTTP edge: the raw dict lives only here and in openai_protocol,
which turns it into a router GenerateRequest. A field that is absent or null
reads as None, as the OpenAI API treats null as "use the default".
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from services.router.gateway.errors import ApiError, bad_request

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
MAX_JSON_DEPTH = 32  # no OpenAI request nests deeper than ~6 (messages[i].content[j].text)
# A \uD800-\uDFFF escape: the only way a JSON text that is valid UTF-8 can carry a UTF-16 surrogate.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def parse_json_object(raw: bytes) -> Body:
    """Request bytes -> Body. 400s: invalid UTF-8, invalid JSON, NaN/Infinity, a non-object, nesting deeper
    than MAX_JSON_DEPTH, and strings with lone surrogates (valid JSON, but not Unicode text: no UTF-8
    encoding, so no tokenizer or protobuf field can take them)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(None, f"the request body is not valid UTF-8 ({exc.reason} at byte {exc.start})")
    try:
        data = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise bad_request(None, f"the request body nests arrays or objects more than {MAX_JSON_DEPTH} deep")
    except (json.JSONDecodeError, ValueError) as exc:
        raise bad_request(None, f"the request body is not valid JSON: {exc}")
    if not isinstance(data, dict):
        raise bad_request(None, f"the request body must be a JSON object, got {type(data).__name__}")
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH or _SURROGATE_ESCAPE.search(raw):
        check_depth_and_text(data)
    return Body(data)


def check_depth_and_text(data: dict[str, Any]) -> None:
    """400 naming the first value nested deeper than MAX_JSON_DEPTH or string with a lone surrogate."""
    stack: list[tuple[Any, str, int]] = [(data, "", 1)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                raise bad_request(path or None, "contains a lone UTF-16 surrogate escape (\\ud800-\\udfff "
                                                "not part of a pair), which is not valid Unicode text")
            continue
        if not isinstance(value, (dict, list)):
            continue
        if depth > MAX_JSON_DEPTH:
            field = re.split(r"[.\[]", path, maxsplit=1)[0]  # the top-level field: the full path is as deep
            raise bad_request(field or None, f"nests arrays or objects more than {MAX_JSON_DEPTH} deep")
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            stack.append((key, path, depth))  # keys are strings too (dict keys; list indexes pass)
            stack.append((item, _child_path(path, key), depth + 1))


def _child_path(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class Body:
    """One request's JSON object, read field by field."""

    def __init__(self, data: dict[str, Any]):
        self._data = data

    def names(self) -> list[str]:
        return list(self._data)

    def raw(self, name: str) -> Any:
        return self._data.get(name)

    def has(self, name: str) -> bool:
        return self._data.get(name) is not None

    def get_int(self, name: str, lo: int = INT32_MIN, hi: int = INT32_MAX) -> int | None:
        value = self._data.get(name)
        if value is None:
            return None
        if not is_int(value):
            raise _wrong_type(name, "an integer", value)
        if not lo <= value <= hi:
            raise bad_request(name, f"must be in [{lo}, {hi}], got {value}")
        return value

    def get_number(self, name: str) -> float | None:
        value = self._data.get(name)
        if value is None:
            return None
        if not is_number(value):
            raise _wrong_type(name, "a number", value)
        number = float(value) if abs(value) < 1e308 else math.inf  # 1e999 parses as inf; huge ints overflow
        if not math.isfinite(number):
            raise bad_request(name, f"must be a finite number, got {show(value)}")
        return number

    def get_bool(self, name: str) -> bool | None:
        value = self._data.get(name)
        if value is not None and not isinstance(value, bool):
            raise _wrong_type(name, "a boolean", value)
        return value

    def get_str(self, name: str) -> str | None:
        value = self._data.get(name)
        if value is not None and not isinstance(value, str):
            raise _wrong_type(name, "a string", value)
        return value

    def get_object(self, name: str) -> dict[str, Any] | None:
        value = self._data.get(name)
        if value is not None and not isinstance(value, dict):
            raise _wrong_type(name, "an object", value)
        return value

    def get_list(self, name: str) -> list[Any] | None:
        value = self._data.get(name)
        if value is not None and not isinstance(value, list):
            raise _wrong_type(name, "an array", value)
        return value

    def get_str_list(self, name: str) -> list[str] | None:
        """A string or an array of strings (e.g. `stop`), as a list."""
        value = self._data.get(name)
        if value is None or isinstance(value, str):
            return None if value is None else [value]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise _wrong_type(name, "a string or an array of strings", value)
        return value

    def get_int_list(self, name: str, lo: int = INT32_MIN, hi: int = INT32_MAX) -> list[int] | None:
        value = self.get_list(name)
        if value is not None:
            check_int_list(name, value, lo, hi)
        return value


def check_int_list(name: str, values: list[Any], lo: int = INT32_MIN, hi: int = INT32_MAX) -> None:
    bad = next((i for i, v in enumerate(values) if not is_int(v) or not lo <= v <= hi), None)
    if bad is not None:  # an index: the bad value itself may be null
        raise bad_request(name, f"must be an array of integers in [{lo}, {hi}], got {show(values[bad])}")


def _wrong_type(name: str, expected: str, value: Any) -> ApiError:
    return bad_request(name, f"must be {expected}, got {show(value)}")


def show(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 40 else text[:37] + "..."
