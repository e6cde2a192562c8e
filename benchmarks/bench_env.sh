# Sourced by the benchmark scripts (benchmarks/peer/*.sh, benchmarks/goodput/run.sh) from the repository
# root: the default model's folder and name, a log folder, and wait_health.
MODEL_DIR=$(.venv/bin/python -c "from distserve.engine.model_loader import resolve_model_path; print(resolve_model_path('default:small'))")
NAME=distserve-small
LOGS=$(mktemp -d)

wait_health() {  # URL PID: waits (5 min at most) until URL/health answers, or fails when PID has exited
  for _ in $(seq 1 300); do
    curl -sf -o /dev/null "$1/health" && return 0
    kill -0 "$2" 2>/dev/null || { echo "server exited; logs in $LOGS" >&2; return 1; }
    sleep 1
  done
  echo "not healthy: $1" >&2; return 1
}
