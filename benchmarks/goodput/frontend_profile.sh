#!/usr/bin/env bash
# Where the router's and gateway's CPU goes per streamed token: starts `distserve up` (default:small,
# the defaults), warms it, then runs benchmarks.goodput.frontend_cost (CPU per token, from /proc) while
# py-spy samples the router and the gateway. Writes OUT_DIR/frontend_cost.json, each process's
# collapsed stacks (OUT_DIR/{router,gateway}.folded: flamegraph.pl or speedscope read them) and their
# summaries (OUT_DIR/{router,gateway}.txt: the most inclusive functions and the hottest leaves).
#
#   bash benchmarks/goodput/frontend_profile.sh OUT_DIR [DTYPE] [frontend_cost args...]
#   PY_SPY=/path/to/py-spy bash benchmarks/goodput/frontend_profile.sh /tmp/front bfloat16 --rate inf
#
# SOURCE (default: this checkout) is the checkout whose services run (python -m from its root, with this
# checkout's .venv): SOURCE=/tmp/base after `git worktree add /tmp/base BASE_COMMIT` profiles that commit.
# py-spy is not a dependency: `pip install py-spy` into any environment and point PY_SPY at it;
# PY_SPY_ARGS adds py-spy options (--native, to see into grpc.aio's Cython core, needs blocking
# sampling: PY_SPY_ARGS=--native PY_SPY_BLOCKING=1, which pauses the process at each sample).
# Sampling costs the profiled processes little (py-spy reads them from outside), but it takes a core
# share of its own: compare frontend_cost.json from runs with PY_SPY=none, not from profiled runs.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=$1; DTYPE=${2:-bfloat16}; shift $(( $# >= 2 ? 2 : 1 ))
PY_SPY=${PY_SPY:-py-spy}
PY=$(pwd)/.venv/bin/python
SOURCE=${SOURCE:-$(pwd)}
mkdir -p "$OUT"
MODEL_DIR=$("$PY" -c "from distserve.engine.model_loader import resolve_model_path; print(resolve_model_path('default:small'))")
LOGS=$(mktemp -d)
for _ in $(seq 1 60); do curl -sf -o /dev/null http://127.0.0.1:8000/health || break; sleep 1; done  # an earlier run's
(cd "$SOURCE" && exec setsid "$PY" -m distserve.cli up --model default:small --dtype "$DTYPE" --gateway-port 8000 \
  --log-dir "$LOGS" >"$LOGS/up.log" 2>&1) &
pid=$!
trap 'kill -TERM -- -"$pid" 2>/dev/null; wait "$pid" 2>/dev/null || true' EXIT
for _ in $(seq 1 300); do curl -sf -o /dev/null http://127.0.0.1:8000/health && break; sleep 1; done
"$PY" -m distserve.cli bench --url http://127.0.0.1:8000 --tokenizer "$MODEL_DIR" --rates inf --num-prompts 8 \
  --input-len 64 --output-len 32 --out "$LOGS/warmup" >/dev/null
spies=()
if [ "$PY_SPY" != none ]; then
  for name in router gateway; do
    module=services.router; [ $name = gateway ] && module=services.router.gateway
    target=$(pgrep -f -- "-m $module( |$)" | head -1)
    "$PY_SPY" record --pid "$target" ${PY_SPY_ARGS:-} --format raw --rate 200 $([ -n "${PY_SPY_BLOCKING:-}" ] || echo --nonblocking) --output "$OUT/$name.folded" \
      >"$LOGS/spy-$name.log" 2>&1 &
    spies+=($!)
  done
  sleep 1
fi
"$PY" -m benchmarks.goodput.frontend_cost --tokenizer "$MODEL_DIR" --out "$OUT/frontend_cost.json" "$@"
for spy in "${spies[@]}"; do kill -INT "$spy" 2>/dev/null || true; wait "$spy" || true; done
if [ "$PY_SPY" != none ]; then
  for name in router gateway; do
    "$PY" -m benchmarks.goodput.folded_summary "$OUT/$name.folded" | tee "$OUT/$name.txt"
  done
fi
