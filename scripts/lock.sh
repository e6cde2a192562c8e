#!/usr/bin/env bash
# The lock: exact, hash-checked versions of everything setup, CI and the container image install,
# direct and transitive, except torch (installed first, with --no-deps, from its pinned CPU build).
#   bash scripts/lock.sh          refresh after a change to pyproject.toml's dependencies (keeps every
#                                 pin that still fits; add --upgrade to move everything to the newest)
#   bash scripts/lock.sh --check  fail when the lock no longer matches pyproject.toml (CI runs this)
# Files: requirements/lock.txt (the runtime: the image), requirements/lock-dev.txt (runtime + the dev
# extra: setup and CI; the same versions where they overlap), requirements/uv.txt (the installer),
# requirements/build.txt (the build backend of the project's own editable install).
# Resolved for CPython 3.11 on x86_64 Linux (manylinux_2_28), the machines CI and the image run on.
# torch's CPU wheel is read for its dependencies only: TORCH_FIND_LINKS (default /opt/wheels, where this
# machine keeps it) else PyTorch's CPU index; the CUDA build on PyPI would drag the nvidia-* packages in.
set -euo pipefail
cd "$(dirname "$0")/.."
UV=${UV:-.venv/bin/uv}
[ -x "$UV" ] || UV=uv
check=0; extra=()
for arg in "$@"; do
  case "$arg" in
    --check) check=1 ;;
    *) extra+=("$arg") ;;
  esac
done
TORCH_FIND_LINKS=${TORCH_FIND_LINKS:-/opt/wheels}
if [ -d "$TORCH_FIND_LINKS" ]; then torch_source=(--find-links "$TORCH_FIND_LINKS")
else torch_source=(--index https://download.pytorch.org/whl/cpu --index-strategy unsafe-best-match); fi

compile() {  # compile OUT [uv pip compile args...]: OUT's pins are kept where they still fit
  local out=$1; shift
  "$UV" pip compile -q pyproject.toml --generate-hashes --no-emit-package torch \
    --python-version 3.11 --python-platform x86_64-manylinux_2_28 "${torch_source[@]}" \
    --custom-compile-command "bash scripts/lock.sh" -o "$out" "$@" ${extra[@]+"${extra[@]}"}
}

lock() {  # writes requirements/{lock,lock-dev,uv}.txt in the current folder, keeping the pins they hold
  compile requirements/lock.txt
  compile requirements/lock-dev.txt --extra dev -c requirements/lock.txt
  # uv itself: the pinned version is kept (the installer of the lock is part of it); --upgrade moves it
  local uv_pin; uv_pin=$(sed -n 's/^\(uv==[^ ]*\).*/\1/p' requirements/uv.txt 2>/dev/null || true)
  echo "${uv_pin:-uv}" > requirements/uv.in
  "$UV" pip compile -q requirements/uv.in --generate-hashes --python-version 3.11 \
    --python-platform x86_64-manylinux_2_28 --custom-compile-command "bash scripts/lock.sh" \
    -o requirements/uv.txt ${extra[@]+"${extra[@]}"}
  rm requirements/uv.in
  # The build backend for the editable install of the project ([build-system] requires)
  python3 -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["build-system"]["requires"]))' \
    > requirements/build.in
  "$UV" pip compile -q requirements/build.in --generate-hashes --python-version 3.11 \
    --python-platform x86_64-manylinux_2_28 --custom-compile-command "bash scripts/lock.sh" \
    -o requirements/build.txt ${extra[@]+"${extra[@]}"}
  rm requirements/build.in
}

if [ "$check" = 1 ]; then
  # Lock a copy (pyproject.toml and the committed pins, same relative paths) and compare.
  tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
  UV=$(realpath "$(command -v "$UV")")
  cp pyproject.toml "$tmp/" && cp -r requirements "$tmp/"
  (cd "$tmp" && lock)
  # Pins only: a wheel uploaded later for a pinned version adds a hash without making the lock stale.
  pins() { sed -n 's/^\([A-Za-z0-9._-]*==[^ ]*\).*/\1/p' "$1"; }
  for f in lock.txt lock-dev.txt uv.txt build.txt; do
    if ! diff -u <(pins "requirements/$f") <(pins "$tmp/requirements/$f"); then
      echo "error: requirements/$f is out of date with pyproject.toml: run bash scripts/lock.sh and commit" >&2
      exit 1
    fi
  done
  echo "lock is in sync with pyproject.toml"
else
  mkdir -p requirements
  lock
  echo "wrote requirements/lock.txt, lock-dev.txt, uv.txt, build.txt"
fi
