"""The compiled kernels' build: one per set of sources, headers and flags, running on torch's thread pool."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

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


def test_build_name_changes_with_where_the_sources_are_and_the_environment(tmp_path, monkeypatch):
    """Two checkouts (or virtual environments) with the same sources get their own build folders:
    build.ninja names sources and torch's headers by absolute path, so a shared one rebuilt each switch."""
    names = []
    for checkout in ("one", "two"):
        csrc = tmp_path / checkout / "csrc"
        csrc.mkdir(parents=True)
        (csrc / "kernel.cpp").write_text("// same\n")
        monkeypatch.setattr(cpu_kernels, "_CSRC", csrc)
        monkeypatch.setattr(cpu_kernels, "_SOURCES", [csrc / "kernel.cpp"])
        names.append(cpu_kernels._build_name(["-O3"]))
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "other-venv"))
    names.append(cpu_kernels._build_name(["-O3"]))
    assert len(set(names)) == 3


def test_the_build_runs_this_environments_ninja_and_restores_path(monkeypatch):
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    with cpu_kernels.ninja_first_on_path():
        found = shutil.which("ninja")
    assert found == os.path.join(cpu_kernels.ninja_directory(), "ninja") and os.access(found, os.X_OK)
    assert os.environ["PATH"] == "/usr/bin:/bin"


_LOAD = "from distserve.engine.cpu_kernels import cpu_kernels; assert cpu_kernels() is not None"


def _load_with_path(path: str) -> None:
    env = {**os.environ, "PATH": path, "DISTSERVE_CPU_KERNELS": "1"}
    done = subprocess.run([sys.executable, "-c", _LOAD], env=env, capture_output=True, text=True, timeout=900,
                          cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr[-2000:]


def _build_outputs() -> dict[str, int]:
    directory = cpu_kernels.kernels_build_directory()
    return {p.name: p.stat().st_mtime_ns for p in directory.iterdir() if p.suffix in (".o", ".so")}


def test_loading_with_or_without_the_venv_on_path_does_not_rebuild():
    """setup.sh builds without .venv/bin on PATH, workers load with it (a system ninja first, then the
    package's): the second load must find the first's build, not compile every kernel again."""
    venv_bin = os.path.dirname(sys.executable)
    system_first = os.pathsep.join(["/usr/bin", "/bin", venv_bin])
    _load_with_path(system_first)
    built = _build_outputs()
    _load_with_path(os.pathsep.join([venv_bin, "/usr/bin", "/bin"]))
    _load_with_path(system_first)
    assert built and _build_outputs() == built


# Run in a fresh interpreter: torch's OpenMP pool starts its worker threads at the first parallel loop,
# so the thread count before and after one kernel call shows whether the kernel ran on the pool.
_POOL_PROBE = """
import json, os, torch
torch.manual_seed(0)
torch.set_num_threads(2)
from distserve.engine.cpu_kernels import cpu_kernels
kernels = cpu_kernels()
assert kernels is not None, "the CPU kernels did not build"
batch, heads, head_dim, block = 4, 2, 8, 4
q = torch.randn(batch, heads, head_dim)
cache = torch.randn(2, batch + 1, block, heads, head_dim)
tables = torch.arange(batch).view(batch, 1)
lens = torch.tensor([4, 3, 2, 1])
threads_before = len(os.listdir("/proc/self/task"))
on_two = kernels.paged_decode_attention(q, cache, tables, lens, 0, 0.5)
threads_after = len(os.listdir("/proc/self/task"))
torch.set_num_threads(1)
on_one = kernels.paged_decode_attention(q, cache, tables, lens, 0, 0.5)
print(json.dumps({"new_threads": threads_after - threads_before, "same": bool(torch.equal(on_one, on_two))}))
"""


def test_the_kernels_run_on_torchs_thread_pool_with_the_same_result():
    """Built with OpenMP, a kernel's at::parallel_for splits its loop over torch's threads (without,
    it ran on the calling thread alone); splitting it does not change a bit of the output."""
    probe = subprocess.run([sys.executable, "-c", _POOL_PROBE], capture_output=True, text=True, timeout=600,
                           cwd=Path(__file__).parents[2])
    assert probe.returncode == 0, probe.stderr[-2000:]
    result = json.loads(probe.stdout.strip().splitlines()[-1])
    assert result == {"new_threads": 1, "same": True}
