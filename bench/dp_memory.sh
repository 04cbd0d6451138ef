#!/usr/bin/env bash
# Peak resident memory per rank of data-parallel training (issue 26): the default model,
# experts in the model (train.experts = model: every parameter data parallel), ZeRO stage
# $ZERO (1: Adam state sharded, the default; 2: gradients too), accum = ranks (24 rows per
# rank), 2 steps, at R = 1, 2 and 4 ranks. Each rank's VmHWM comes from /usr/bin/time (so a
# sigma without summary.json's peak_rss_mib_per_rank can be compared; set ZERO= empty for one
# that has no dist.zero).
#   [RANKS="1 2 4"] [ZERO=1|2] bench/dp_memory.sh [path/to/sigma] [extra --set ...]
set -euo pipefail
sigma=${1:-build/sigma}
shift || true
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for R in ${RANKS:-1 2 4}; do
  zero=()
  [ -n "${ZERO-1}" ] && zero=(--set dist.zero="${ZERO-1}")
  mpirun --allow-run-as-root --oversubscribe --bind-to none -np "$R" \
    bash -c '/usr/bin/time -f "%M" -o "$0/rss.$OMPI_COMM_WORLD_RANK" "$@"' "$work" \
    "$sigma" train --set train.accum="$R" --set train.experts=model --set train.steps=2 \
    --set train.threads=1 --set train.eval_rows=24 --quiet "${zero[@]}" "$@" > "$work/log.$R" 2>&1 \
    || { cat "$work/log.$R"; exit 1; }
  per_rank=$(for r in $(seq 0 $((R - 1))); do echo $(( $(cat "$work/rss.$r") / 1024 )); done | paste -sd' ')
  echo "R=$R peak RSS MiB per rank: $per_rank"
done
