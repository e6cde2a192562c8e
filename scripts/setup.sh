#!/usr/bin/env bash
# Sets up a fresh machine: a virtual environment in .venv with the project and its test tools.
# torch is installed first from its pinned CPU build (an unpinned torch pulls a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e '.[dev]'
# Build the CPU kernels now (cached per machine) so no worker start waits ~30 s for the compiler.
.venv/bin/python -m distserve.engine.cpu_kernels || echo "warning: no C++ compiler; decode uses the slower torch path"
echo "setup done: .venv/bin/distserve is ready"
