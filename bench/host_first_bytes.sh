#!/usr/bin/env bash
# Bytes out of each host per step, direct against host-first sums and gathers
# (dist/host_first.h, docs/distributed.md "Placement across hosts"), on the simulated cluster
# (2 hosts x 2 ranks, links unshaped: bytes do not depend on load or rate), beside what
# bench/step_model_sim.py predicts. As root, from the repository root, after a build:
#
#   bench/host_first_bytes.sh build/sigma
#
# Layouts: dense tp 1 x dp 4 and RRE tp 1 x dp 4 (experts parallel over the 4 ranks: each data
# group holds 2 ranks of each host, aligned with tree_sum's tree), dense tp 2 x dp 2 (one rank
# of each data group per host: nothing to add first). Per layout and path (SIGMA_HOST_FIRST=0
# or 1): a run of STEPS steps and one of WARM + 1; the bytes per step are the difference of
# their eth0 counters over the steps between (start-up and the end of a run send bytes of
# their own), as TCP payload (x 1448 / 1514, MTU 1500), as bench/step_model_check.sh counts them.
#
# Environment: D (256), LAYERS (4), HEADS (8), CONTEXT (64), BATCH (4), RRE_BLOCKS (2), STEPS
# (10), WARM (3): bench/step_model_check.sh's model.
set -euo pipefail
sigma=$(realpath "$1")
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
D=${D:-256} LAYERS=${LAYERS:-4} HEADS=${HEADS:-8} CONTEXT=${CONTEXT:-64} BATCH=${BATCH:-4}
RRE_BLOCKS=${RRE_BLOCKS:-2} STEPS=${STEPS:-10} WARM=${WARM:-3}
SHORT=$((WARM + 1)) K=1
tmp=$(mktemp -d /tmp/host-first-bytes.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
source "$here/sim_bench_lib.sh"

params_local() { sed -n 's/.*MiB on the most loaded rank, \([0-9.]*\) MiB unsharded.*/\1/p' "$1" | head -1 |
  awk '{printf "%d", $1 * 1048576 / 8}'; }
tx() { awk -F= -v k="$2.eth0.tx_bytes" '$1 == k {print $2}' "$1"; }

echo "machine: $("$here/machine.sh"), $(nproc) cores; load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "model: d=$D layers=$LAYERS heads=$HEADS context=$CONTEXT, $BATCH rows per rank; bytes per step over steps $SHORT..$STEPS"
echo "| layout | path | MiB out of h0 per step: measured / predicted | h1 measured | the line at start |"
echo "|---|---|---:|---:|---|"
for layout in "dense tp1 x dp4|1|0" "RRE tp1 x dp4, experts parallel|1|$RRE_BLOCKS" "dense tp2 x dp2|2|0"; do
  IFS='|' read -r name TP RRE <<<"$layout"
  DP=$((4 / TP))
  for hf in 0 1; do
    mpi_x="-x OMP_WAIT_POLICY=passive -x SIGMA_HOST_FIRST=$hf"
    base="--set model.d_model=$D --set model.layers=$LAYERS --set model.heads=$HEADS \
--set model.context=$CONTEXT --set model.rre_layers=$RRE --set train.batch=$BATCH \
--set train.threads=1 --set train.log_every=1 --set train.ckpt_every=0 \
--set dist.tp=$TP --set dist.ckpt_layout=sharded"
    model="$base --set train.steps=$SHORT"
    cluster none false "$tmp/short" "$tmp/short.stats" >/dev/null
    model="$base --set train.steps=$STEPS"
    cluster none false "$tmp/full" "$tmp/full.stats" >/dev/null
    line=$(sed -n 's/^sigma train: data group: //p' "$tmp/full.log" | head -1)
    python3 - "$here" "$name" "$TP" "$DP" "$RRE" "$(params_local "$tmp/full.log")" "$hf" \
      "$(tx "$tmp/full.stats" h0)" "$(tx "$tmp/short.stats" h0)" \
      "$(tx "$tmp/full.stats" h1)" "$(tx "$tmp/short.stats" h1)" "${line:-one rank of the group per host}" <<PY
import sys
sys.path.insert(0, sys.argv[1])
import step_model_sim as sim
name, tp, dp, rre, params, hf, f0, s0, f1, s1, line = sys.argv[2:]
x = dict(hosts=2, slots=2, tp=int(tp), dp=int(dp), rre=int(rre), params_local=int(params), d=$D,
         layers=$LAYERS, tokens_per_rank=$BATCH * $CONTEXT * $K, groups=[2, 3, 4], ref_ms=0.0,
         link="none", rate_bps=0, overlap=False, host_first=hf == "1")
pred = sim.predict(x, {})["host_bytes"]
per = lambda f, s: (int(f) - int(s)) / ($STEPS - $SHORT) * 1448 / 1514 / 2**20
said = line.split("): ", 1)[-1].split(" (")[0].split(":")[0]  # "sums host-first", "sums direct"
print(f"| {name} | {'host-first' if hf == '1' else 'direct (SIGMA_HOST_FIRST=0)'} | "
      f"{per(f0, s0):.2f} / {pred / 2**20:.2f} | {per(f1, s1):.2f} | {said} |")
PY
    rm -rf "$tmp/short" "$tmp/full"
  done
done
echo "load average at end: $(cut -d' ' -f1-3 /proc/loadavg)"
