"""Typed reads of one JSON request body: a field of the wrong type is a 400 naming it.

This is the HTTP edge: the raw dict lives only here and in openai_protocol,
which turns it into a router GenerateRequest. A field that is absent or null
reads as None, as the OpenAI API treats null as "use the default".
"""

from __future__ import annotations

import json
import math
from typing import Any

from services.router.gateway.errors import ApiError, bad_request

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


def parse_json_object(raw: bytes) -> Body:
    """Request bytes -> Body; invalid UTF-8, invalid JSON, NaN/Infinity or a non-object are 400s."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(None, f"the request body is not valid UTF-8 ({exc.reason} at byte {exc.start})")
    try:
        data = json.loads(text, parse_constant=_reject_constant)
    except (json.JSONDecodeError, ValueError) as exc:
        raise bad_request(None, f"the request body is not valid JSON: {exc}")
    if not isinstance(data, dict):
        raise bad_request(None, "the request body must be a JSON object")
    return Body(data)


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
    bad = next((v for v in values if not is_int(v) or not lo <= v <= hi), None)
    if bad is not None:
        raise bad_request(name, f"must be an array of integers in [{lo}, {hi}], got {show(bad)}")


def _wrong_type(name: str, expected: str, value: Any) -> ApiError:
    return bad_request(name, f"must be {expected}, got {show(value)}")


def show(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 40 else text[:37] + "..."
