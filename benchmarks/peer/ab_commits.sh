#!/usr/bin/env bash
# A/B of two commits of distserve alone, alternating in one window (drift hits both alike): `distserve up`
# 1 prefill + 1 decode on default:small, the peer-bench workload at one rate, for each seed.
#
#   bash benchmarks/peer/ab_commits.sh BASE_COMMIT [DTYPE] [RATE] [SEEDS]
#   bash benchmarks/peer/ab_commits.sh a8ef48a bfloat16 4 "1 2"
#
# Prints "label seed TTFT_p50_ms TPOT_p50_ms output_tok_s" per run; JSONs in $OUT (default /tmp/ab).
# BENCH_ARGS are passed to the measured `vllm bench serve` runs, e.g. "--random-prefix-len 768 --num-prompts 40".
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
BASE=$1; DTYPE=${2:-bfloat16}; RATE=${3:-4}; SEEDS=${4:-"1 2"}; OUT=${OUT:-/tmp/ab}
PEER_BENCH=${PEER_BENCH:-$(cd "$ROOT/.." && pwd)/shared/peer-bench}
MODEL_DIR=$(.venv/bin/python -c "from distserve.engine.model_loader import resolve_model_path; print(resolve_model_path('default:small'))")
WORKTREE=$(mktemp -d)
git worktree add -q "$WORKTREE" "$BASE"
trap 'git worktree remove --force "$WORKTREE"' EXIT
mkdir -p "$OUT"

run() {  # LABEL SOURCE_DIR SEED: the source dir's code runs (python -m from its root), with this venv
  (cd "$2" && setsid "$ROOT/.venv/bin/python" -m distserve.cli up --model default:small --dtype "$DTYPE" \
    --prefill 1 --decode 1 --gateway-port 8000 --served-model-name distserve-small >"$OUT/up_$1.log" 2>&1 &)
  for _ in $(seq 1 120); do curl -sf -o /dev/null http://127.0.0.1:8000/health && break; sleep 1; done
  bash "$PEER_BENCH/bench.sh" http://127.0.0.1:8000 distserve-small "$MODEL_DIR" inf "$OUT/warmup.json" \
    --num-prompts 8 --seed 1000 >/dev/null
  bash "$PEER_BENCH/bench.sh" http://127.0.0.1:8000 distserve-small "$MODEL_DIR" "$RATE" "$OUT/$1_$3.json" \
    --seed "$3" ${BENCH_ARGS:-} >/dev/null
  pkill -f "distserve.cli up"; sleep 4
  python3 -c "import json; d=json.load(open('$OUT/$1_$3.json')); print('$1', $3, round(d['median_ttft_ms'], 1), \
round(d['median_tpot_ms'], 1), round(d['output_throughput'], 1))"
}

for seed in $SEEDS; do
  run base "$WORKTREE" "$seed"
  run head "$ROOT" "$seed"
done
