#!/usr/bin/env bash
# docs/scaling.md's step-time model held against measured runs on the simulated cluster
# (issue 38; docs/distributed.md). As root, from the repository root, after a build:
#
#   bench/step_model_check.sh build/sigma [ROUNDS=3] [RATE...=1gbit 10gbit]
#
# Three layouts on 2 hosts x 2 ranks: dense tp 1 x dp 4, dense tp 2 x dp 2 (tp inside a host),
# RRE tp 1 x dp 4 with the experts parallel over the 4 ranks. Per layout: the compute reference
# (bench/sim_bench_lib.sh: the same per-rank work, cores shared alike, no dp exchange), a run
# with unshaped links and runs at each RATE, each with and without dist.overlap; each run's
# median step (after WARM) and its per-host byte counters (scripts/sim-cluster.sh --stats).
# The unshaped runs calibrate the exchanges' costs on this machine (bench/step_model_sim.py:
# ZeRO's per byte on each path, host-first from the first layout and direct from the second
# (with HOST_FIRST=0 both are direct: the second's unshaped runs are then checks), the experts'
# per round from the third; blocking and overlapped apart); every shaped run is
# predicted and printed beside its measurement. Every figure is the median over ROUNDS rounds
# (a round runs every layout's runs in turn, so a busy spell of the machine falls on all of
# them); rounds taken by separate invocations pool by concatenating their OUT files.
#
# Environment: D (256), LAYERS (4), HEADS (8), CONTEXT (64), BATCH (4), K (1), RRE_BLOCKS (2),
# STEPS (10), WARM (3), LATENCY (one-way, e.g. 100us: tc netem; default none), OUT (write the
# runs' JSON lines there, as they finish: `python3 bench/step_model_sim.py OUT` re-reads them),
# HOST_FIRST (1; 0 runs SIGMA_HOST_FIRST=0, the direct sums and gathers: dist/host_first.h).
set -euo pipefail
sigma=$(realpath "$1")
rounds=${2:-3}
shift $(($# >= 2 ? 2 : 1))
rates=("$@")
((${#rates[@]})) || rates=(1gbit 10gbit)
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
D=${D:-256} LAYERS=${LAYERS:-4} HEADS=${HEADS:-8} CONTEXT=${CONTEXT:-64} BATCH=${BATCH:-4}
K=${K:-1} RRE_BLOCKS=${RRE_BLOCKS:-2} STEPS=${STEPS:-10} WARM=${WARM:-3} LATENCY=${LATENCY:-}
HOST_FIRST=${HOST_FIRST:-1}
SHORT=$((WARM + 1))
tmp=$(mktemp -d /tmp/step-model.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
mpi_x="-x OMP_WAIT_POLICY=passive -x SIGMA_HOST_FIRST=$HOST_FIRST"
source "$here/sim_bench_lib.sh"
runs=${OUT:-$tmp/runs.jsonl}
: >"$runs"
lat_s=$(python3 -c "import sys,re; m=re.fullmatch(r'([0-9.]+)(us|ms)?', sys.argv[1]); \
print(float(m[1]) * (1e-3 if m[2] == 'ms' else 1e-6) if m else 0)" "${LATENCY:-0}")

bps() { case $1 in none) echo 0 ;; *gbit) echo $((${1%gbit} * 1000000000)) ;; *mbit) echo $((${1%mbit} * 1000000)) ;; esac; }
# Shared parameters of one rank (its tp slice): the run's "... MiB unsharded" line is numel x 8 B.
# (Runs are not --quiet for this line; their end-of-run save is sharded: no bytes cross hosts.)
params_local() { sed -n 's/.*MiB on the most loaded rank, \([0-9.]*\) MiB unsharded.*/\1/p' "$1" | head -1 |
  awk '{printf "%d", $1 * 1048576 / 8}'; }
tx_bytes() { awk -F= '/^h0.eth0.tx_bytes=/ {print $2}' "$1"; }

echo "machine: $("$here/machine.sh"), $(nproc) cores; load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "model: d=$D layers=$LAYERS heads=$HEADS context=$CONTEXT, $BATCH rows x $K micro-batches per rank; $STEPS steps (median after $WARM); latency ${LATENCY:-none}"
for ((round = 1; round <= rounds; round++)); do
for layout in "dense tp1 x dp4|1|0" "dense tp2 x dp2|2|0" "RRE tp1 x dp4, experts parallel|1|$RRE_BLOCKS"; do
  IFS='|' read -r name TP RRE <<<"$layout"
  DP=$((4 / TP))
  model="--set model.d_model=$D --set model.layers=$LAYERS --set model.heads=$HEADS \
--set model.context=$CONTEXT --set model.rre_layers=$RRE --set train.batch=$BATCH \
--set train.steps=$STEPS --set train.threads=1 --set train.log_every=1 --set train.ckpt_every=0 \
--set dist.tp=$TP --set dist.ckpt_layout=sharded"
  # RRE's reference: an experts-parallel rank of 4 holds K/4 of a group's K experts and runs the
  # rows of all 4 ranks routed to them (the default groups: markov 2, copy 3, arith 4), so its
  # products are fuller than a single process's with every expert; the reference runs 1 expert
  # per group (the rank's rows, in one product per group) and keeps 3/4 of that expert update
  # (an experts-parallel rank updates (2 + 3 + 4) / 3 / 4 = 0.75 experts per group on average).
  ref_set=() REF_UPDATE_KEEP=
  if ((RRE)); then
    ref_set=(--set 'model.groups=[{"name":"markov","experts":1},{"name":"copy","experts":1},{"name":"arith","experts":1}]')
    REF_UPDATE_KEEP=0.75
  fi
  ref=$(REF_UPDATE_KEEP=${REF_UPDATE_KEEP:-$(python3 -c "print(1 / $DP)")} reference)
  echo "round $round, $name: reference $ref ms/step; load $(cut -d' ' -f1 /proc/loadavg)"
  # The bytes a step sends out of a host: a run's counters less those of a run of SHORT steps
  # (start-up and the end of a run send bytes of their own), over the steps between.
  full_model=$model
  model="$model --set train.steps=$SHORT"
  cluster none false "$tmp/short" "$tmp/short.stats" >/dev/null
  model=$full_model
  short_tx=$(tx_bytes "$tmp/short.stats")
  rm -rf "$tmp/short"
  for rate in none "${rates[@]}"; do
    for mode in false true; do
      out=$tmp/run-$TP-$RRE-$rate-$mode
      t=$(cluster "$rate" "$mode" "$out" "$out.stats")
      tx=$(tx_bytes "$out.stats")
      echo "round $round, $name: $rate overlap=$mode: $t ms/step; h0 sent $tx bytes in $STEPS steps"
      python3 - "$name" "$TP" "$DP" "$RRE" "$(params_local "$out.log")" "$ref" "$t" "$rate" \
        "$(bps "$rate")" "$mode" "$tx" "$short_tx" "$lat_s" >>"$runs" <<PY
import json, sys
name, tp, dp, rre, params, ref, t, link, rate, mode, tx, short_tx, lat = sys.argv[1:]
print(json.dumps(dict(layout=name, hosts=2, slots=2, tp=int(tp), dp=int(dp), rre=int(rre),
    params_local=int(params), d=$D, layers=$LAYERS, tokens_per_rank=$BATCH * $CONTEXT * $K,
    groups=[2, 3, 4], ref_ms=float(ref), measured_ms=float(t), link=link, rate_bps=int(rate),
    latency_s=float(lat), overlap=mode == "true", host_first=$HOST_FIRST == 1,
    measured_host_bytes=(int(tx) - int(short_tx)) / ($STEPS - $SHORT) * 1448 / 1514)))
PY
      rm -rf "$out"
    done
  done
done
done
python3 "$here/step_model_sim.py" "$runs"
echo "load average at end: $(cut -d' ' -f1-3 /proc/loadavg)"
