#!/usr/bin/env bash
# The GPU proof, in one command, on a machine with a CUDA device and no network (one H100/H200, 16 cores,
# its own CPython 3.12, torch with CUDA, Triton, CuPy). Needs .gpu-wheels/, fetched beforehand where PyPI
# is reachable (bash scripts/gpu_wheels.sh) and carried with the tree.
#   bash scripts/gpu_check.sh [OUT_DIR]      (OUT_DIR default: $OUT, else benchmarks/results/gpu)
# 1. a venv over the machine's Python that sees its torch (--system-site-packages), with the carried
#    wheels installed --no-deps where the machine's are missing or older than the lock's;
# 2. tests/gpu (greedy token-exact against transformers on the device in fp32, the KV cache sized from
#    the GPU's memory): pytest's report in OUT_DIR/tests.txt;
# 3. benchmarks.gpu_report for default:small and the 0.5B shape in bf16: OUT_DIR/report.json.
# Exits non-zero when the tests fail; the report runs either way. Budget: under 5 minutes of device time.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-${OUT:-benchmarks/results/gpu}}
mkdir -p "$OUT_DIR"
PYTHON=${PYTHON:-python3}
started=$(date +%s)
if ! $PYTHON -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "error: no CUDA device visible to $PYTHON's torch" >&2
  exit 1
fi
[ -d .gpu-wheels ] || { echo "error: .gpu-wheels/ is missing: run bash scripts/gpu_wheels.sh where PyPI is reachable" >&2; exit 1; }
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || true
  $PYTHON -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"; } | tee "$OUT_DIR/machine.txt"

# 1. the venv: the machine's torch stays; ours come from the carried wheels
$PYTHON -m venv --system-site-packages .gpu-venv || { echo "error: $PYTHON cannot make a venv" >&2; exit 1; }
VPY=.gpu-venv/bin/python
# packaging compares versions; the machine may not have it, so it is read from its carried wheel (a zip)
PACKAGING_WHEEL=$(ls .gpu-wheels/packaging-*.whl)
PYTHONPATH=$PACKAGING_WHEEL $VPY - <<'PY' > .gpu-venv/wanted.txt || { echo "error: listing the wheels to install failed" >&2; exit 1; }
import importlib.metadata as md, pathlib, re
from packaging.version import Version
for wheel in sorted(pathlib.Path(".gpu-wheels").glob("*.whl")):
    name, version = wheel.name.split("-")[:2]
    try:
        have = Version(md.version(re.sub("_", "-", name)))
    except md.PackageNotFoundError:
        have = None
    if have is None or have < Version(version):
        print(wheel)
PY
if [ -s .gpu-venv/wanted.txt ]; then
  # shellcheck disable=SC2046
  $VPY -m pip install -q --no-index --no-deps $(cat .gpu-venv/wanted.txt) || { echo "error: installing the carried wheels failed" >&2; exit 1; }
fi
echo "installed $(wc -l < .gpu-venv/wanted.txt) carried wheels in $(( $(date +%s) - started )) s"

# 2. the GPU suite
export DISTSERVE_CPU_KERNELS=0  # nothing to compile for the CPU path here
$VPY -m pytest tests/gpu -q -p no:cacheprovider --timeout 240 2>&1 | tee "$OUT_DIR/tests.txt"
status=${PIPESTATUS[0]}

# 3. the report
$VPY -m benchmarks.gpu_report --dtype bfloat16 --out "$OUT_DIR/report.json" > "$OUT_DIR/report.log" 2>&1 \
  || echo "warning: benchmarks.gpu_report failed: $OUT_DIR/report.log" >&2
echo "gpu_check: tests exit $status, $(( $(date +%s) - started )) s in all; results in $OUT_DIR"
exit "$status"
