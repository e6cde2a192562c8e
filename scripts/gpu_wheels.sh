#!/usr/bin/env bash
# Fetches, here (where PyPI is reachable), the wheels scripts/gpu_check.sh installs on a GPU machine that
# has no network: CPython 3.12, x86_64 Linux, CUDA 13, with its own torch, Triton and CuPy. Into
# .gpu-wheels/ (ignored by git; carry it to the device run, e.g. `run`'s carry=[".gpu-wheels"]).
#   bash scripts/gpu_wheels.sh [--budget-mib N]
# What: requirements/lock.txt's pins (the runtime) and the test tools, minus what the machine brings
# (torch and its dependencies; cuda-bindings and cuda-core, 14 MiB that ucxx and rmm import only for
# device buffers, which the host-staged KV path does not use) and what the check does not use (plots; structured output, whose xgrammar
# loads with the first grammar; huggingface_hub's CLI and Xet downloads), with the CUDA 12 builds of UCX,
# UCXX and RMM swapped for their CUDA 13 builds; each --no-deps, the closure being the lock's.
# Everything that travels to the device is capped at 64 MiB, so wheels are slimmed
# (scripts/slim_wheel.py): libucx without static libraries, perftest, tools and duplicate .so copies;
# libucxx and librmm without C++ headers; transformers without the model families the check does not
# load (it keeps Llama, Qwen2/3, Mistral and the auto classes). Fails when the folder exceeds the budget
# (default 52 MiB, leaving room for the tree).
set -euo pipefail
cd "$(dirname "$0")/.."
BUDGET_MIB=52
[ "${1:-}" = "--budget-mib" ] && BUDGET_MIB=$2
OUT=.gpu-wheels
PY=.venv/bin/python
# The machine's own, or not needed there (plots, the CPU-only torch's companions).
SKIP='^(torch|triton|sympy|mpmath|networkx|filelock|fsspec|jinja2|markupsafe|typing-extensions|setuptools|numpy'
SKIP+='|cuda-bindings|cuda-core|cuda-pathfinder'
SKIP+='|matplotlib|contourpy|cycler|fonttools|kiwisolver|pillow|pyparsing|python-dateutil|tzdata'
SKIP+='|xgrammar|apache-tvm-ffi|pydantic|pydantic-core|annotated-types|typing-inspection'
SKIP+='|hf-xet|typer|rich|shellingham|markdown-it-py|mdurl)=='
pins=$(grep -E '^[a-z0-9_.-]+==' requirements/lock.txt | sed 's/ .*//' | grep -Ev "$SKIP" \
  | sed -E 's/^(libucx|libucxx|ucxx|rmm|librmm)-cu12==/\1-cu13==/')  # the lock's versions, CUDA 13 builds
tests=$(grep -E '^(pytest|pytest-asyncio|pytest-timeout|iniconfig|pluggy)==' requirements/lock-dev.txt | sed 's/ .*//')
rm -rf "$OUT" && mkdir -p "$OUT"
# shellcheck disable=SC2086  # one word per requirement
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
  --abi abi3 --abi none --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d "$OUT" $pins $tests
$PY scripts/slim_wheel.py "$OUT"/libucx_cu13-*.whl '\.a$' '/bin/' 'perftest' '\.so\.[0-9]+\.[0-9]+\.[0-9]+$'
$PY scripts/slim_wheel.py "$OUT"/libucxx_cu13-*.whl '/include/'
$PY scripts/slim_wheel.py "$OUT"/librmm_cu13-*.whl '/include/'
$PY scripts/slim_wheel.py "$OUT"/transformers-*.whl \
  '^transformers/models/(?!(__init__\.py|auto|llama|qwen2|qwen3|mistral|encoder_decoder)(/|$))' 
size_mib=$(( $(du -sb "$OUT" | cut -f1) / 1048576 ))
echo "$(ls "$OUT" | wc -l) wheels, $size_mib MiB in $OUT"
if [ "$size_mib" -gt "$BUDGET_MIB" ]; then
  du -b "$OUT"/* | sort -rn | head -5
  echo "error: over the $BUDGET_MIB MiB budget" >&2
  exit 1
fi
