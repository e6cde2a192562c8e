"""distserve.transfer.bound_listener's build: where it cannot compile, it says why once and gives None
(the sender then falls back to ucxx's listener); a library already built is loaded without a compiler."""

from __future__ import annotations

import logging

import pytest

from distserve.transfer import bound_listener


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """The module as if this process had not tried to build, building into tmp_path."""
    monkeypatch.setattr(bound_listener, "_tried", False)
    monkeypatch.setattr(bound_listener, "_module", None)
    monkeypatch.setattr(bound_listener, "build_directory", lambda: tmp_path)
    return tmp_path


def test_without_a_compiler_the_extension_is_none_and_the_warning_says_why(fresh, monkeypatch, caplog):
    monkeypatch.setenv("CXX", "/bin/false")
    with caplog.at_level(logging.WARNING):
        assert bound_listener.extension() is None
        assert bound_listener.extension() is None  # tried once: no second attempt, no second warning
    warnings = [r for r in caplog.records if "cannot build the address-bound UCX listener" in r.message]
    assert len(warnings) == 1 and "/bin/false" in warnings[0].getMessage()
    assert not list(fresh.glob("*.so"))  # nothing half-built left to be loaded later


def test_an_existing_build_is_kept_and_not_compiled_again(fresh, monkeypatch):
    library = fresh / f"bound_listener{bound_listener.sysconfig.get_config_var('EXT_SUFFIX')}"
    library.write_bytes(b"built before")
    monkeypatch.setenv("CXX", "/bin/false")  # a compile would fail
    assert bound_listener.build(fresh) == library and library.read_bytes() == b"built before"
