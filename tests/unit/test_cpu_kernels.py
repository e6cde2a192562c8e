"""The compiled kernels' build name: one build per set of sources, headers and flags."""

from __future__ import annotations

from distserve.engine import cpu_kernels


def test_build_name_changes_with_a_header_a_source_or_a_flag(tmp_path, monkeypatch):
    (tmp_path / "kernel.cpp").write_text('#include "shared.h"\n')
    (tmp_path / "shared.h").write_text("// v1\n")
    monkeypatch.setattr(cpu_kernels, "_CSRC", tmp_path)
    monkeypatch.setattr(cpu_kernels, "_SOURCES", [tmp_path / "kernel.cpp"])
    first = cpu_kernels._build_name(["-O3"])
    assert first.startswith("distserve_cpu_kernels_") and cpu_kernels._build_name(["-O3"]) == first
    (tmp_path / "shared.h").write_text("// v2\n")  # torch's loader alone would not rebuild for this
    after_header = cpu_kernels._build_name(["-O3"])
    (tmp_path / "kernel.cpp").write_text('#include "shared.h"\n// changed\n')
    after_source = cpu_kernels._build_name(["-O3"])
    assert len({first, after_header, after_source, cpu_kernels._build_name(["-O2"])}) == 4
