#!/usr/bin/env bash
# Bytes out of each host per step with the experts spread over every rank against each expert
# group on the ranks of its own micro-batches (dist.placement = spread | by_group;
# docs/distributed.md "Placement across hosts"), on the simulated cluster (2 hosts x 2 ranks,
# links unshaped: bytes do not depend on load or rate). As root, from the repository root, after
# a build:
#
#   bench/expert_placement_bytes.sh build/sigma
#
# Layout: RRE tp 1 x dp 4, experts parallel, train.accum 4 (one micro-batch per rank, as
# by_group needs at least one per group), the default 3 expert groups: by_group puts them on
# ranks {0, 1}, {2} and {3}, so on hosts h0, h1, h1. Per placement, a run of STEPS steps and one of
# WARM + 1; the bytes per step are the difference of their eth0 counters over the steps between,
# as TCP payload (x 1448 / 1514, MTU 1500), as bench/host_first_bytes.sh counts them. The
# difference between the placements is the expert rows that cross hosts (the shared weights'
# sums are the same in both).
#
# Environment: D (256), LAYERS (4), HEADS (8), CONTEXT (64), BATCH (4 rows per rank),
# RRE_BLOCKS (2), STEPS (10), WARM (3).
set -euo pipefail
sigma=$(realpath "$1")
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
D=${D:-256} LAYERS=${LAYERS:-4} HEADS=${HEADS:-8} CONTEXT=${CONTEXT:-64} BATCH=${BATCH:-4}
RRE_BLOCKS=${RRE_BLOCKS:-2} STEPS=${STEPS:-10} WARM=${WARM:-3}
SHORT=$((WARM + 1)) TP=1 DP=4 K=1
tmp=$(mktemp -d /tmp/expert-placement-bytes.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
source "$here/sim_bench_lib.sh"
tx() { awk -F= -v k="$2.eth0.tx_bytes" '$1 == k {print $2}' "$1"; }
mib() { python3 -c "print(f'{($1 - $2) / ($STEPS - $SHORT) * 1448 / 1514 / 2**20:.2f}')"; }

echo "machine: $("$here/machine.sh"), $(nproc) cores; load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "model: d=$D layers=$LAYERS ($RRE_BLOCKS RRE) heads=$HEADS context=$CONTEXT, $BATCH rows per rank, accum 4; bytes per step over steps $SHORT..$STEPS"
echo "| placement | MiB out of h0 per step | h1 | the run's line |"
echo "|---|---:|---:|---|"
for placement in spread by_group; do
  mpi_x="-x OMP_WAIT_POLICY=passive"
  base="--set model.d_model=$D --set model.layers=$LAYERS --set model.heads=$HEADS \
--set model.context=$CONTEXT --set model.rre_layers=$RRE_BLOCKS --set train.batch=$BATCH \
--set train.threads=1 --set train.log_every=1 --set train.ckpt_every=0 \
--set train.experts=parallel --set dist.placement=$placement --set dist.ckpt_layout=sharded"
  model="$base --set train.steps=$SHORT"
  cluster none false "$tmp/short" "$tmp/short.stats" >/dev/null
  model="$base --set train.steps=$STEPS"
  cluster none false "$tmp/full" "$tmp/full.stats" >/dev/null
  line=$(sed -n 's/^sigma train: expert groups by host: //p' "$tmp/full.log" | head -1)
  echo "| $placement | $(mib "$(tx "$tmp/full.stats" h0)" "$(tx "$tmp/short.stats" h0)") |" \
       "$(mib "$(tx "$tmp/full.stats" h1)" "$(tx "$tmp/short.stats" h1)") | ${line:-(none)} |"
  rm -rf "$tmp/short" "$tmp/full"
done
echo "load average at end: $(cut -d' ' -f1-3 /proc/loadavg)"
