"""Shared fixtures: the tiny default model, built once per machine and cached."""

from __future__ import annotations

import pytest

from distserve.engine.default_model import ensure_default_model


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    return str(ensure_default_model("tiny"))
