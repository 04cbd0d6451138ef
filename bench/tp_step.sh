#!/usr/bin/env bash
# Tensor parallelism on R ranks (issue 26): step time, tp traffic per rank, peak resident
# memory per rank and the loss at dist.tp = 1, 2, 4 (dp = R / tp), the same global batch.
# The tp sides run alternately in one script so that they see the same load.
#   [R=4 TPS="1 2 4" STEPS=20] bench/tp_step.sh [path/to/sigma] [extra --set ...]
set -euo pipefail
sigma=${1:-build/sigma}
shift || true
R=${R:-4}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for tp in ${TPS:-1 2 4}; do
  out="$work/tp$tp"
  mpirun --allow-run-as-root --oversubscribe --bind-to none -np "$R" \
    bash -c '/usr/bin/time -f "%M" -o "$0.rss.$OMPI_COMM_WORLD_RANK" "$@"' "$out" \
    "$sigma" train --set model.rre_layers=0 --set train.experts=model --set train.accum="$R" \
    --set train.steps="${STEPS:-20}" --set train.threads=1 --set train.eval_rows=24 \
    --set train.log_every=1 --set dist.tp="$tp" --quiet --out "$out" "$@" > "$work/log.$tp" 2>&1 \
    || { cat "$work/log.$tp"; exit 1; }
  rss=$(for r in $(seq 0 $((R - 1))); do echo $(( $(cat "$out.rss.$r") / 1024 )); done | paste -sd' ')
  python3 - "$out" "$tp" "$rss" <<'PY'
import json, sys
out, tp, rss = sys.argv[1], sys.argv[2], sys.argv[3]
recs = [json.loads(l) for l in open(out + "/metrics.jsonl") if l.strip()]
s = json.load(open(out + "/summary.json"))
tp_x = s.get("tp_exchange", {})
sec_per_step = s["steps"] and s["tokens"] / s["tokens_per_s"] / s["steps"]
print(f"tp={tp}: loss {recs[-1]['loss']:.9f} s/step {sec_per_step:.2f} tokens/s {s['tokens_per_s']:.0f} "
      f"tp all-reduce MiB/step/rank {tp_x.get('mib_per_step_per_rank', 0):.2f} "
      f"calls/step {tp_x.get('calls_per_step', 0):.0f} peak RSS MiB per rank {rss}")
PY
done
