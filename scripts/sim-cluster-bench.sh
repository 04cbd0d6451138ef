#!/usr/bin/env bash
# Step time of a tiny 4-rank run (tp 2 x dp 2, configs/tiny.json, one thread per rank) on one
# simulated host x 4 ranks against 2 hosts x 2 at each link rate given (docs/distributed.md,
# "A simulated cluster"). The layouts take turns, REPEATS rounds, so that a change in the
# machine's load falls on all of them. Per run: the fastest 5-step window after the first
# (the least disturbed by other work on a shared machine); printed: every run's, then the
# median and the best over the rounds. As root:
#   scripts/sim-cluster-bench.sh build/sigma [REPEATS] [RATE...]    (default: 3 2gbit 200mbit;
#   RATE none: 2 hosts with unshaped links)
set -euo pipefail
sigma=$(realpath "$1") repeats=${2:-3}
shift $(($# >= 2 ? 2 : 1))
rates=("$@")
((${#rates[@]})) || rates=(2gbit 200mbit)
here=$(cd "$(dirname "$0")" && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
steps=60 every=5 tokens_per_step=512  # 4 rows x 4 micro-batches x 32 tokens
best_window_ms() {
  python3 -c '
import json, sys
w = [json.loads(l)["tokens_per_s"] for l in open(sys.argv[1]) if l.strip()][1:]
print(f"{min(int(sys.argv[2]) / t * 1e3 for t in w):.1f}")' "$1" "$tokens_per_step"
}
layouts=("1 host x 4|1|4|")
for rate in "${rates[@]}"; do  # "none": 2 hosts, links not shaped
  layouts+=("2 hosts x 2 @ $rate|2|2|${rate#none}")
done
for rre in 0 1; do
  declare -A times=() sent=()
  for ((i = 0; i < repeats; i++)); do
    for layout in "${layouts[@]}"; do
      IFS='|' read -r label hosts slots rate <<<"$layout"
      rm -rf "$tmp/out"
      "$here/sim-cluster.sh" --hosts "$hosts" --slots "$slots" ${rate:+--bandwidth "$rate"} \
        --stats "$tmp/stats" --timeout 300 -- "$sigma" train --config "$here/../configs/tiny.json" \
        --set train.steps=$steps --set train.batch=4 --set train.accum=4 --set train.threads=1 \
        --set train.log_every=$every --set dist.tp=2 --set model.rre_layers="$rre" --quiet \
        --out "$tmp/out" >"$tmp/log" 2>&1 || { cat "$tmp/log"; exit 1; }
      times[$label]+="$(best_window_ms "$tmp/out/metrics.jsonl") "
      sent[$label]=$(sed -n 's/^h0.eth0.tx_bytes=//p' "$tmp/stats")
    done
  done
  for layout in "${layouts[@]}"; do
    label=${layout%%|*}
    read -r -a all <<<"${times[$label]}"
    sorted=$(printf '%s\n' "${all[@]}" | sort -g)
    echo "rre_layers=$rre, $label: ms/step ${all[*]}; median $(sed -n "$(((${#all[@]} + 1) / 2))p" <<<"$sorted"), best $(head -1 <<<"$sorted"); h0 sent $((sent[$label] / steps)) B/step on eth0"
  done
  unset times sent
done
