"""Service configuration: one frozen dataclass per service, every field a flag and an env var.

Each field carries `help` in its metadata. The flag is `--field-name`; the
environment variable is `metadata["env"]` when given (shared settings such as
DISTSERVE_REDIS_URL) or `<prefix><FIELD_NAME>`. Precedence: flag, env, default.
Validation lives in each dataclass's `__post_init__`, raising ConfigError that
names the field.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from typing import Any, Sequence, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """A setting is invalid; the message starts with the field's name."""


def setting(default: Any, help: str, env: str | None = None, flag: bool = True) -> Any:
    """flag=False: settable only by the environment variable, for secrets (argv is visible to `ps`)."""
    return dataclasses.field(default=default, metadata={"help": help, "env": env, "flag": flag})


def env_name(field: dataclasses.Field, prefix: str) -> str:
    return field.metadata.get("env") or prefix + field.name.upper()


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def _converter(kind: Any):
    return {"int": int, "float": float, "bool": _parse_bool}.get(getattr(kind, "__name__", kind), str)


def parse_config(cls: type[T], argv: Sequence[str] | None, prefix: str, description: str = "") -> T:
    """Builds cls from command-line flags and environment variables."""
    hints = typing.get_type_hints(cls)
    parser = argparse.ArgumentParser(description=description or cls.__doc__, allow_abbrev=False)  # exact names
    for field in dataclasses.fields(cls):
        name = env_name(field, prefix)
        if not field.metadata.get("flag", True):
            continue
        parser.add_argument(
            "--" + field.name.replace("_", "-"),
            dest=field.name,
            type=_converter(hints[field.name]),
            default=None,
            help=f"{field.metadata.get('help', '')} [env {name}; default {field.default!r}]",
        )
    args = parser.parse_args(argv)
    values = {}
    for field in dataclasses.fields(cls):
        value = getattr(args, field.name, None)
        if value is None and env_name(field, prefix) in os.environ:
            raw = os.environ[env_name(field, prefix)]
            try:
                value = _converter(hints[field.name])(raw)
            except ValueError as exc:
                raise ConfigError(f"{field.name}: {exc}") from exc
        if value is not None:
            values[field.name] = value
    return cls(**values)


def require(condition: bool, field: str, message: str) -> None:
    if not condition:
        raise ConfigError(f"{field}: {message}")
