"""The kernels' build guard: one builder per build, a killed builder's lock never blocks a later start."""

from __future__ import annotations

import multiprocessing
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from distserve.engine import cpu_kernels
from distserve.engine.cpu_kernels import TORCH_BATON, build_guard

WAIT_S = 20.0


def hold_guard(directory: str, held, release) -> None:
    with build_guard(Path(directory)):
        held.set()
        release.wait(WAIT_S)


@pytest.fixture
def holder(tmp_path):
    """A process holding the guard of tmp_path / "build" until its `release` is set (or it is killed)."""
    context = multiprocessing.get_context("spawn")
    held, release = context.Event(), context.Event()
    process = context.Process(target=hold_guard, args=(str(tmp_path / "build"), held, release))
    process.start()
    assert held.wait(WAIT_S), "the holder never took the guard"
    yield process, release
    process.kill()
    process.join(WAIT_S)


def test_a_lock_file_left_by_a_killed_build_is_removed(tmp_path):
    directory = tmp_path / "build"
    directory.mkdir()
    (directory / TORCH_BATON).touch()  # what torch's loader leaves when its process dies mid-build
    with build_guard(directory, wait_s=1.0):
        assert not (directory / TORCH_BATON).exists()


def test_a_live_build_is_waited_for_then_given_up_on(tmp_path, holder):
    process, _ = holder
    (tmp_path / "build" / TORCH_BATON).touch()  # the live builder's own lock: not ours to remove
    with pytest.raises(TimeoutError, match="another process"):
        with build_guard(tmp_path / "build", wait_s=0.5):
            pass
    assert (tmp_path / "build" / TORCH_BATON).exists() and process.is_alive()


def test_the_next_builder_goes_once_the_holder_finishes_or_dies(tmp_path, holder):
    process, _ = holder
    process.kill()
    process.join(WAIT_S)
    with build_guard(tmp_path / "build", wait_s=WAIT_S):  # the flock died with the process
        pass


_LOAD = "from distserve.engine.cpu_kernels import cpu_kernels; assert cpu_kernels() is not None, 'not loaded'"


def test_a_worker_starts_after_a_build_was_killed(tmp_path, monkeypatch):
    """End to end in a fresh interpreter: a build folder with a dead builder's lock file in it (a
    copy of this machine's build, so nothing recompiles) loads at once instead of waiting forever."""
    assert cpu_kernels.cpu_kernels() is not None, "the CPU kernels did not build"
    built = cpu_kernels.kernels_build_directory()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    copy = cpu_kernels.build_directory(built.name)
    shutil.copytree(built, copy, ignore=shutil.ignore_patterns(TORCH_BATON, cpu_kernels.BUILD_FLOCK))
    (copy / TORCH_BATON).touch()
    load = subprocess.run([sys.executable, "-c", _LOAD], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).parents[2])
    assert load.returncode == 0, load.stderr[-2000:]
    assert not (copy / TORCH_BATON).exists()
