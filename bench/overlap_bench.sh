#!/usr/bin/env bash
# Communication hidden behind compute (dist.overlap, docs/distributed.md): the exposed
# communication time per step with and without overlap, on the simulated cluster
# (scripts/sim-cluster.sh: 2 hosts x SLOTS ranks, links shaped to each RATE), side by side in the
# same rounds. As root, from the repository root, after a build:
#
#   bench/overlap_bench.sh build/sigma [ROUNDS=3] [RATE...=1gbit 10gbit]
#
# Per round: the compute reference, then for each rate a run without overlap and one with it
# (their order alternating over the rounds). The reference is the same per-rank work without
# the data-parallel exchange: 4/TP independent copies of one tp group (TP=1: a single process,
# TP=2: mpirun -np 2 inside one host), started at the same time so the machine's cores are
# shared as in the 4-rank runs, each running the same micro-batches per rank of the same model
# (it updates every parameter where a ZeRO rank updates its quarter: a slightly slower
# reference, which makes the exposed time slightly smaller with and without overlap alike).
# A run's step time is the median over its steps after the first WARM; exposed = step time
# minus the same round's reference. Printed: every run, then per rate and mode the median over
# the rounds, the ratio of the medians, and whether every round's overlapped run ended with
# the bits of the one without (every weight tensor compared by hash, `sigma inspect --tensors`).
#
# Environment: D (d_model, 512), LAYERS (4), HEADS (8), CONTEXT (64), BATCH (rows per
# micro-batch, 4), K (micro-batches per rank, 1), TP (1 or 2), SLOTS (ranks per host, 2; 1 gives
# each rank a core of this 2-core machine to itself), RRE (model.rre_layers, 0),
# STEPS (14), WARM (4), EXTRA (more --set arguments for every run), MPI_ARGS (more mpirun
# arguments for the cluster runs, e.g. "--mca btl_tcp_progress_thread 1"), POLL (0 sets
# SIGMA_OVERLAP_POLL=0: no tests of the exchanges at layer boundaries), MTU (the links' MTU, 1500).
set -euo pipefail
sigma=$(realpath "$1")
rounds=${2:-3}
shift $(($# >= 2 ? 2 : 1))
rates=("$@")
((${#rates[@]})) || rates=(1gbit 10gbit)
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
D=${D:-512} LAYERS=${LAYERS:-4} HEADS=${HEADS:-8} CONTEXT=${CONTEXT:-64} BATCH=${BATCH:-4}
K=${K:-1} TP=${TP:-1} RRE=${RRE:-0} STEPS=${STEPS:-14} WARM=${WARM:-4} EXTRA=${EXTRA:-}
MPI_ARGS=${MPI_ARGS:-} POLL=${POLL:-1} SLOTS=${SLOTS:-2}
((TP == 1 || TP == 2)) && ((SLOTS % TP == 0)) || { echo "TP=$TP: 1 or 2, dividing SLOTS=$SLOTS" >&2; exit 2; }
DP=$((2 * SLOTS / TP))
tmp=$(mktemp -d /tmp/overlap-bench.XXXXXX)
trap 'rm -rf "$tmp"' EXIT

model="--set model.d_model=$D --set model.layers=$LAYERS --set model.heads=$HEADS \
--set model.context=$CONTEXT --set model.rre_layers=$RRE --set train.batch=$BATCH \
--set train.steps=$STEPS --set train.threads=1 --set train.log_every=1 --set train.ckpt_every=0 \
--set dist.tp=$TP --quiet $EXTRA"
mpi_x="-x OMP_WAIT_POLICY=passive"
((POLL)) || mpi_x+=" -x SIGMA_OVERLAP_POLL=0"

source "$here/sim_bench_lib.sh"

# A hash of a checkpoint's weights, tensor by tensor in either layout (multi-rank runs save
# sharded; `sigma inspect --tensors` assembles each tensor whole and prints a hash of its bytes).
# A checkpoint that cannot be read hashes to its error, never to another's hash.
weights_hash() {
  local w
  w=$("$sigma" inspect --ckpt "$1" --tensors 2>&1 | grep '^weights ') || { echo "unreadable: $1"; return; }
  sha256sum <<<"$w" | cut -c1-16
}

echo "machine: $("$here/machine.sh"), $(nproc) cores; load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "links: mtu ${MTU:-1500}${LATENCY:+, latency $LATENCY}"
echo "model: d=$D layers=$LAYERS heads=$HEADS context=$CONTEXT rre_layers=$RRE, $BATCH rows x $K micro-batches per rank; tp $TP x dp $DP on 2 hosts x $SLOTS ranks; $STEPS steps (median after $WARM); poll=$POLL; mpirun args: ${MPI_ARGS:-none}"
declare -A exposed=() steps=()
refs=() same=0 compared=0
for ((r = 1; r <= rounds; r++)); do
  ref=$(reference)
  refs+=("$ref")
  echo "round $r: reference (no dp exchange) $ref ms/step; load $(cut -d' ' -f1 /proc/loadavg)"
  for rate in "${rates[@]}"; do
    modes=(false true)
    ((r % 2)) || modes=(true false)
    for mode in "${modes[@]}"; do
      out=$tmp/$rate-$mode-$r
      t=$(cluster "$rate" "$mode" "$out")
      e=$(awk -v a="$t" -v b="$ref" 'BEGIN {printf "%.1f", a - b}')
      steps[$rate-$mode]+="$t "
      exposed[$rate-$mode]+="$e "
      echo "round $r: $rate overlap=$mode: $t ms/step, exposed $e ms"
    done
    compared=$((compared + 1))
    ck=checkpoints/step-$(printf %08d "$STEPS")
    if [[ "$(weights_hash "$tmp/$rate-false-$r/$ck")" == "$(weights_hash "$tmp/$rate-true-$r/$ck")" ]]; then
      same=$((same + 1))
    fi
    rm -rf "$tmp/$rate-false-$r" "$tmp/$rate-true-$r"
  done
done
echo "reference: median $(median "${refs[@]}") ms/step (${refs[*]})"
for rate in "${rates[@]}"; do
  read -r -a off <<<"${exposed[$rate-false]}"
  read -r -a on <<<"${exposed[$rate-true]}"
  mo=$(median "${off[@]}") mn=$(median "${on[@]}")
  read -r -a soff <<<"${steps[$rate-false]}"
  read -r -a son <<<"${steps[$rate-true]}"
  echo "$rate: step ms without overlap $(median "${soff[@]}") (${soff[*]}), with $(median "${son[@]}") (${son[*]}); exposed ms without $mo (${off[*]}), with $mn (${on[*]}); ratio $(awk -v a="$mn" -v b="$mo" 'BEGIN {printf "%.2f", (b > 0) ? a / b : 0}')"
done
echo "same bits with and without overlap: $same of $compared pairs"
echo "load average at end: $(cut -d' ' -f1-3 /proc/loadavg)"
