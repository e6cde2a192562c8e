"""tests/gpu fails, never skips, where no CUDA device is visible: .ci/run leaves it out (scripts/test.sh),
and scripts/gpu_check.sh, which runs it, must not pass a machine it could not test."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_suite_fails_loudly_without_a_gpu():
    done = subprocess.run([sys.executable, "-m", "pytest", "tests/gpu", "-q", "-p", "no:cacheprovider", "-x"],
                          cwd=ROOT, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode not in (0, 5), done.stdout  # 5: nothing collected
    assert "needs a CUDA device" in done.stdout


def test_the_test_command_leaves_the_gpu_suite_out():
    assert "--ignore=tests/gpu" in (ROOT / "scripts" / "test.sh").read_text()
