"""Shared fixtures: the default models, built once per machine and cached."""

from __future__ import annotations

import pytest

from distserve.engine.default_model import ensure_default_model


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    return str(ensure_default_model("tiny"))


@pytest.fixture(scope="session")
def small_model_path() -> str:
    """The README's default model: its decode steps are slow enough (milliseconds, not the tiny model's
    ~0.5 ms) that a long request reliably outlives a test's next few requests."""
    return str(ensure_default_model("small"))


@pytest.fixture(scope="session", autouse=True)
def ucx_stopped_at_exit():
    """Tests that move KV in this process stop ucxx's notifier thread once, at the very end, so pytest
    can exit; stopping it earlier (say, per module) leaves every later in-process transfer broken."""
    yield
    from distserve.transfer import connector

    connector.shutdown("ucx")
