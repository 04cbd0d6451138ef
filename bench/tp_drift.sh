#!/usr/bin/env bash
# Cross-tp drift (issue 26, docs/distributed.md "Determinism across tp"): 200 steps of
# configs/tiny.json with model.heads = 4 on 4 ranks, train.accum = 4, 1 thread per rank, logged
# every step, at tp 1 x dp 4, tp 2 x dp 2 and tp 4 x dp 1, for the dense model, RRE (one expert
# block, expert parallel) and the top-1 learned gate; prints each tp's worst relative loss and
# grad-norm difference against tp 1 over the steps, and the final losses.
#   [STEPS=200] bench/tp_drift.sh [path/to/sigma]
set -euo pipefail
sigma=${1:-build/sigma}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
declare -A models=(
  [dense]="--set model.rre_layers=0 --set train.experts=model"
  [rre]="--set model.rre_layers=1 --set train.experts=parallel"
  [gate]="--set model.rre_layers=1 --set model.router=top1 --set train.experts=parallel")
for m in dense rre gate; do
  for tp in 1 2 4; do
    # shellcheck disable=SC2086
    mpirun --allow-run-as-root --oversubscribe --bind-to none -np 4 "$sigma" train \
      --config configs/tiny.json --set model.heads=4 ${models[$m]} --set train.steps="${STEPS:-200}" \
      --set train.accum=4 --set train.threads=1 --set train.log_every=1 --set train.eval_rows=8 \
      --set dist.tp="$tp" --quiet --out "$work/$m-tp$tp" > "$work/log.$m.$tp" 2>&1 \
      || { cat "$work/log.$m.$tp"; exit 1; }
  done
  python3 - "$work" "$m" <<'PY'
import json, sys
work, m = sys.argv[1], sys.argv[2]
load = lambda tp: [json.loads(l) for l in open(f"{work}/{m}-tp{tp}/metrics.jsonl") if l.strip()]
one = load(1)
for tp in (2, 4):
    o = load(tp)
    wl = max(abs(a["loss"] - b["loss"]) / abs(a["loss"]) for a, b in zip(one, o))
    wg = max(abs(a["grad_norm"] - b["grad_norm"]) / abs(a["grad_norm"]) for a, b in zip(one, o))
    print(f"{m} tp {tp}: worst relative loss {wl:.1e}, grad norm {wg:.1e} over {len(o)} steps; "
          f"final loss {one[-1]['loss']:.9f} -> {o[-1]['loss']:.9f}")
PY
done
