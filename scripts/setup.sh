#!/usr/bin/env bash
# Sets up a fresh machine: a virtual environment in .venv with the project and its test tools, at exactly
# the versions in requirements/ (hash-checked; `bash scripts/lock.sh` refreshes them).
# torch is installed first from its pinned CPU build, outside the hashed lock (an unpinned or PyPI torch
# pulls a multi-GB CUDA build); its dependencies are in the lock.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
py=.venv/bin/python
if ! "$py" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
  echo "warning: the lock is resolved for CPython 3.11; $("$py" -V) may need other versions" >&2
fi
"$py" -m pip install -q --require-hashes --no-deps -r requirements/uv.txt
"$py" -m pip install -q --no-deps torch==2.13.0
uv=(.venv/bin/uv pip --quiet)
"${uv[@]}" install --python "$py" --require-hashes --no-deps -r requirements/lock-dev.txt
"${uv[@]}" install --python "$py" --no-deps --build-constraints requirements/build.txt -e .
"${uv[@]}" check --python "$py"
# Bytecode for every installed module and ours, now: where PYTHONDONTWRITEBYTECODE is set (as on our CI
# machines) Python never writes it, and each process would compile transformers and torch again (a
# tokenizer load 7 s instead of 3; every service start pays it). Idempotent; ~30 s the first time.
"$py" -m compileall -q -j0 -x '/torch/testing/' .venv/lib/python3*/site-packages distserve services \
  || echo "warning: the modules above did not compile to bytecode; their processes start slower" >&2
# Build the CPU kernels now (cached per machine) so no worker start waits ~30 s for the compiler.
"$py" -m distserve.engine.cpu_kernels || echo "warning: no C++ compiler; decode uses the slower torch path"
# And the UCX listener that binds one address (without it the prefill workers' KV listener binds every interface).
"$py" -m distserve.transfer.bound_listener || echo "warning: the KV listener will bind every interface"
echo "setup done: .venv/bin/distserve is ready"
