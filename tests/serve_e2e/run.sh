#!/usr/bin/env bash
# ctest driver of the end-to-end test: installs the pinned openai client (package-lock.json)
# into WORK/node_modules when missing or stale, then runs e2e.mjs from there.
# Usage: run.sh SIGMA_BINARY WORK_DIR
set -euo pipefail
sigma=$1 work=$2 src=$(cd "$(dirname "$0")" && pwd)
command -v node >/dev/null || { echo "serve e2e: node is not installed (scripts/install-deps.sh)"; exit 1; }
command -v npm >/dev/null || { echo "serve e2e: npm is not installed (scripts/install-deps.sh)"; exit 1; }
mkdir -p "$work"
if ! cmp -s "$src/package-lock.json" "$work/package-lock.json" || [[ ! -d $work/node_modules/openai ]]; then
  cp "$src/package.json" "$src/package-lock.json" "$work/"
  # The npm cache too stays in WORK: the test writes nothing outside the build and temp dirs.
  # Three tries, 5 and 15 s apart: a registry hiccup on a fresh build dir is not a failing test.
  for wait in 5 15 0; do
    (cd "$work" && npm ci --no-audit --no-fund --loglevel=error --cache "$work/.npm-cache") && break
    [[ $wait == 0 ]] && { echo "serve e2e: npm ci failed 3 times (the npm registry must be reachable once)"; exit 1; }
    echo "serve e2e: npm ci failed; trying again in $wait s"
    sleep "$wait"
  done
fi
cp "$src/e2e.mjs" "$work/"
exec node "$work/e2e.mjs" "$sigma"
