#!/usr/bin/env bash
# How evenly ZeRO spreads a real-text model over the data ranks (issue 38): the
# ../shared/data model (configs/shared-data.train.json: d=128, vocabulary 16,384, experts in
# the model) trained 4 steps on R ranks with dist.zero = Z and saved once in the sharded
# layout. Prints each rank's peak RSS (/usr/bin/time), each rank's checkpoint files (model +
# Adam, KiB) with the largest / mean, and the banner's state on the most loaded rank.
# Run from the folder that holds runs/shards and runs/shards-heldout (docs/data.md, "Training
# on ../shared/data").
#   bench/zero_balance.sh path/to/sigma [R=4] [Z=3]
set -euo pipefail
sigma=$(realpath "$1")
R=${2:-4}
Z=${3:-3}
config=$(realpath "$(dirname "$0")/../configs/shared-data.train.json")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/rss"
mpirun --allow-run-as-root --oversubscribe --bind-to none -np "$R" \
  bash -c '/usr/bin/time -f "%M" -o "$0/rss.$OMPI_COMM_WORLD_RANK" "$@"' "$work/rss" \
  "$sigma" train --config "$config" --set dist.zero="$Z" --set train.experts=model \
  --set train.steps=4 --set train.ckpt_every=4 --set train.threads=1 --set train.eval_rows=16 \
  --out "$work/run" > "$work/log" 2>&1 || { cat "$work/log"; exit 1; }
rss=$(for r in $(seq 0 $((R - 1))); do echo $(( $(cat "$work/rss/rss.$r") / 1024 )); done | paste -sd' ')
files=$(for r in $(seq 0 $((R - 1))); do
  f=$work/run/checkpoints/step-00000004/shard-$(printf %04d "$r")
  echo $(( ($(stat -c %s "$f.model.safetensors") + $(stat -c %s "$f.adam.safetensors")) / 1024 ))
done | paste -sd' ')
ratio=$(echo "$files" | tr ' ' '\n' | awk '{s += $1; if ($1 > m) m = $1} END {printf "%.2f", m / (s / NR)}')
echo "R=$R zero=$Z peak RSS MiB per rank: $rss; checkpoint KiB per rank: $files (largest / mean $ratio)"
grep -o "sharded (ZeRO-.*" "$work/log" | head -1 || true
