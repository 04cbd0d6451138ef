#!/usr/bin/env bash
# The tp all-reduce before and after a change (issue 38: gather-and-add against reduce-scatter +
# all-gather), through `sigma train` on R ranks: for each tp, the two builds alternate for
# ROUNDS rounds so that they see the same load; prints each run's step time (train seconds /
# steps, from summary.json) and the tp group's MiB sent per rank and step, and checks that
# both builds wrote the same final weights and losses, bit for bit.
#   [R=4 TPS="2 4" STEPS=4 ROUNDS=3] bench/tp_allreduce.sh OLD_SIGMA NEW_SIGMA [extra --set ...]
set -euo pipefail
old=$1 new=$2
shift 2
R=${R:-4}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for tp in ${TPS:-2 4}; do
  for round in $(seq "${ROUNDS:-3}"); do
    for side in old new; do
      bin=$old; [ "$side" = new ] && bin=$new
      out="$work/$side.tp$tp.$round"
      mpirun --allow-run-as-root --oversubscribe --bind-to none -np "$R" "$bin" train \
        --set model.rre_layers=0 --set train.experts=model --set train.accum="$R" \
        --set train.steps="${STEPS:-4}" --set train.threads=1 --set train.eval_rows=24 \
        --set train.log_every=1 --set dist.tp="$tp" --quiet --out "$out" "$@" > "$out.log" 2>&1 \
        || { cat "$out.log"; exit 1; }
      python3 - "$out" "$tp" "$side" "$round" <<'PY'
import json, sys
out, tp, side, rnd = sys.argv[1:]
s = json.load(open(out + "/summary.json"))
x = s.get("tp_exchange", {})
print(f"tp={tp} {side} round {rnd}: s/step {s['tokens'] / s['tokens_per_s'] / s['steps']:.3f} "
      f"tp MiB/step/rank {x.get('mib_per_step_per_rank', 0):.1f} calls/step {x.get('calls_per_step', 0):.1f}")
PY
    done
    a="$work/old.tp$tp.$round" b="$work/new.tp$tp.$round"
    ck=$(cat "$a/checkpoints/latest")
    # Tensor by tensor in either layout (multi-rank runs save sharded), read by the new build.
    if cmp -s <("$new" inspect --ckpt "$a/checkpoints/$ck" --tensors | grep '^weights ') \
              <("$new" inspect --ckpt "$b/checkpoints/$ck" --tensors | grep '^weights ') &&
       cmp -s <(grep -o '"loss":[^,]*' "$a/metrics.jsonl") <(grep -o '"loss":[^,]*' "$b/metrics.jsonl"); then
      echo "tp=$tp round $round: same weights and losses"
    else
      echo "tp=$tp round $round: the builds DIFFER"; exit 1
    fi
  done
done
