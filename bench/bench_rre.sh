#!/usr/bin/env bash
# RRE against dense and the learned-gate baselines on the prepared ../shared/data (issue 4):
# the same model (configs/shared-data.train.json: d=128, 4 blocks, the top 2 expert blocks,
# 6 domains in 4 groups), the same data order and token budget, one run per variant:
#   dense    rre_layers = 0
#   rre4     RRE, 4 experts per group        rre16   RRE, 16 experts per group
#   top1     Switch gate, 4 experts          top2    GShard gate, 4 experts
# Active parameters per token are equal for dense, rre* and top1 (one FFN per block; the gate
# adds d*K); top2 runs two experts per token (more compute, reported as is).
# Prints a markdown table: held-out loss per domain after the budget, their mean, the routing
# imbalance over the run (max/mean tokens per expert in a group, worst block), the share of
# (token, choice) pairs the gates dropped over capacity, and the run's tokens/s (on a shared
# machine that last figure is mostly other people's load: then bench_rre_step, which runs the
# variants interleaved at the same shape, is printed after the table for throughput).
# Usage: bench/bench_rre.sh [--build DIR] [--out DIR] [--steps N] [--data DIR] [--heldout DIR]
#                           [--variants "dense rre4 ..."] [--report-only] [--threads N]
set -euo pipefail
BUILD=build OUT=runs/bench-rre STEPS=600 DATA=runs/shards HELDOUT=runs/shards-heldout
VARIANTS="dense rre4 rre16 top1 top2" REPORT_ONLY=0 THREADS=2
while [ $# -gt 0 ]; do
  case "$1" in
    --build) BUILD=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --steps) STEPS=$2; shift 2 ;;
    --data) DATA=$2; shift 2 ;;
    --heldout) HELDOUT=$2; shift 2 ;;
    --variants) VARIANTS=$2; shift 2 ;;
    --report-only) REPORT_ONLY=1; shift ;;
    --threads) THREADS=$2; shift 2 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
ROOT=$(cd "$(dirname "$0")/.." && pwd)
groups() {  # groups JSON with K experts each
  echo "[{\"name\":\"en\",\"experts\":$1},{\"name\":\"zh\",\"experts\":$1},{\"name\":\"enzh\",\"experts\":$1},{\"name\":\"code\",\"experts\":$1}]"
}
mkdir -p "$OUT"
for v in $VARIANTS; do
  [ "$REPORT_ONLY" = 1 ] && break
  case "$v" in
    dense) set_args=(--set model.rre_layers=0) ;;
    rre4) set_args=(--set "model.groups=$(groups 4)") ;;
    rre16) set_args=(--set "model.groups=$(groups 16)") ;;
    top1) set_args=(--set "model.groups=$(groups 4)" --set model.router=top1) ;;
    top2) set_args=(--set "model.groups=$(groups 4)" --set model.router=top2) ;;
    *) echo "unknown variant $v" >&2; exit 2 ;;
  esac
  rm -rf "${OUT:?}/$v"
  echo "== $v" >&2
  "$BUILD/sigma" train --quiet --config "$ROOT/configs/shared-data.train.json" \
    --set train.steps="$STEPS" --set train.log_every=50 --set data.path="$DATA" \
    --set data.eval_path="$HELDOUT" --set train.threads="$THREADS" "${set_args[@]}" \
    --out "$OUT/$v" > "$OUT/$v.log"
done
python3 - "$OUT" $VARIANTS <<'PY'
import json, sys
out, variants = sys.argv[1], sys.argv[2:]
rows = []
for v in variants:
    s = json.load(open(f"{out}/{v}/summary.json"))
    recs = [json.loads(l) for l in open(f"{out}/{v}/metrics.jsonl")]
    imb = f'{max(s["load_imbalance"].values()):.2f}' if "load_imbalance" in s else "-"
    dropped = sum(n for r in recs for n in r.get("dropped", {}).values())
    k = 2 if v == "top2" else 1
    choices = k * s["tokens"] * max(1, len(s.get("load_imbalance", {})))
    rows.append((v, s, imb, dropped / choices))
doms = sorted(rows[0][1]["domains"])
print(f"held-out loss after {rows[0][1]['tokens']} training tokens")
print("| variant | " + " | ".join(doms) + " | mean | imbalance | dropped | run tok/s |")
print("|" + "---|" * (len(doms) + 5))
for v, s, imb, drop in rows:
    losses = [s["domains"][d]["loss"] for d in doms]
    print(f"| {v} | " + " | ".join(f"{x:.3f}" for x in losses) +
          f" | {sum(losses)/len(losses):.3f} | {imb} | {100*drop:.1f} % | {s['tokens_per_s']:.0f} |")
PY
"$BUILD/bench_rre_step" --threads "$THREADS"
