#!/usr/bin/env bash
# Step time of host-first sums and gathers against the direct path (SIGMA_HOST_FIRST=0;
# dist/host_first.h, docs/distributed.md "Placement across hosts") on the simulated cluster:
# 2 hosts x 2 ranks, tp 1 x dp 4 (each data group holds 2 ranks of each host), links shaped to
# RATE, with and without dist.overlap, dense and RRE (experts parallel). As root, from the
# repository root, after a build:
#
#   bench/host_first_step.sh build/sigma [ROUNDS=2] [RATE=1gbit]
#
# Per round and layout, the 4 runs (path x overlap) one after the other, the paths' order
# alternating over the rounds; printed: every run's median step (after WARM), then per layout
# and mode the medians over the rounds and host-first / direct.
#
# Environment: D (256), LAYERS (4), HEADS (8), CONTEXT (64), BATCH (4), RRE_BLOCKS (2), STEPS
# (10), WARM (3): bench/step_model_check.sh's model.
set -euo pipefail
sigma=$(realpath "$1")
rounds=${2:-2}
rate=${3:-1gbit}
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
D=${D:-256} LAYERS=${LAYERS:-4} HEADS=${HEADS:-8} CONTEXT=${CONTEXT:-64} BATCH=${BATCH:-4}
RRE_BLOCKS=${RRE_BLOCKS:-2} STEPS=${STEPS:-10} WARM=${WARM:-3}
TP=1 DP=4 K=1
tmp=$(mktemp -d /tmp/host-first-step.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
source "$here/sim_bench_lib.sh"

echo "machine: $("$here/machine.sh"), $(nproc) cores; load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "model: d=$D layers=$LAYERS heads=$HEADS context=$CONTEXT, $BATCH rows per rank; tp 1 x dp 4 on 2 hosts x 2 ranks, links $rate; $STEPS steps (median after $WARM)"
declare -A t=()
for ((r = 1; r <= rounds; r++)); do
  for layout in "dense|0" "RRE|$RRE_BLOCKS"; do
    IFS='|' read -r name RRE <<<"$layout"
    model="--set model.d_model=$D --set model.layers=$LAYERS --set model.heads=$HEADS \
--set model.context=$CONTEXT --set model.rre_layers=$RRE --set train.batch=$BATCH \
--set train.steps=$STEPS --set train.threads=1 --set train.log_every=1 --set train.ckpt_every=0 \
--set dist.tp=1 --set dist.ckpt_layout=sharded --quiet"
    paths=(0 1)
    ((r % 2)) || paths=(1 0)
    for hf in "${paths[@]}"; do
      mpi_x="-x OMP_WAIT_POLICY=passive -x SIGMA_HOST_FIRST=$hf"
      for mode in false true; do
        ms=$(cluster "$rate" "$mode" "$tmp/run")
        rm -rf "$tmp/run"
        t[$name-$hf-$mode]+="$ms "
        echo "round $r: $name, $([[ $hf == 1 ]] && echo host-first || echo direct), overlap=$mode: $ms ms/step; load $(cut -d' ' -f1 /proc/loadavg)"
      done
    done
  done
done
for name in dense RRE; do
  for mode in false true; do
    read -r -a d <<<"${t[$name-0-$mode]}"
    read -r -a h <<<"${t[$name-1-$mode]}"
    md=$(median "${d[@]}") mh=$(median "${h[@]}")
    echo "$name, overlap=$mode: direct $md ms (${d[*]}), host-first $mh ms (${h[*]}): host-first / direct $(awk -v a="$mh" -v b="$md" 'BEGIN {printf "%.2f", a / b}')"
  done
done
echo "load average at end: $(cut -d' ' -f1-3 /proc/loadavg)"
