#!/usr/bin/env bash
# Kill campaign against sharded checkpoints under mpirun (dist.ckpt_layout = sharded): tp 2 on
# 2 ranks, expert parallel, saving every 2 steps of 6. One rank (0, which commits, then 1, a
# peer) is SIGKILLed just before its Nth disk-changing call (tests/kill_at.cpp), for N over its
# points (at most MAX per rank, evenly spread); mpirun ends the other. After each kill every
# complete checkpoint must open (`sigma inspect`: every rank's file with its size and
# checksum), no half-written one may count, and a resume from the newest (or a fresh start
# when none was committed) at the same layout must end with the uninterrupted run's files.
# ASYNC (train.ckpt_async, default true): true writes each save on a writer thread per rank
# while the next steps run (a kill lands during the writes, between them and the ranks'
# agreement, or in the commit); false writes it in the foreground.
# Usage: test_sharded_checkpoint_kills.sh SIGMA KILL_AT_SHIM [MAX] [ASYNC]   (~3 s per point)
set -euo pipefail
SIGMA=$(realpath "$1")
SHIM=$(realpath "$2")
MAX=${3:-8}
ASYNC=${4:-true}
command -v mpirun >/dev/null || { echo "SKIP: no mpirun"; exit 0; }
W=$(mktemp -d "${TMPDIR:-/tmp}/sigma-shard-kills-XXXXXX")
trap 'rm -rf "$W"' EXIT
cd "$W"
export OMP_WAIT_POLICY=passive OMP_NUM_THREADS=1
args=(--quiet --set model.d_model=32 --set model.heads=2 --set model.layers=3 --set model.context=16
      --set train.batch=4 --set train.accum=2 --set train.steps=6 --set train.ckpt_every=2
      --set train.log_every=1 --set train.eval_rows=4 --set dist.tp=2 --set dist.ckpt_layout=sharded
      --set dist.timeout_s=10 --set train.ckpt_async="$ASYNC")
mpi=(mpirun --allow-run-as-root --oversubscribe --bind-to none -np 2)
fail() { echo "FAIL: $*"; ls -laR D 2>/dev/null | head -60; exit 1; }
# Runs sigma on 2 ranks; rank $1 gets the shim with the environment in $2 (empty: none).
on2() {
  local victim=$1 env=$2
  shift 2
  "${mpi[@]}" bash -c "if [ \"\$OMPI_COMM_WORLD_RANK\" = $victim ] && [ -n '$env' ]; then export LD_PRELOAD='$SHIM' $env; fi; exec \"\$@\"" \
    _ "$SIGMA" "$@"
}
# The newest checkpoint's tensor files (every rank's shards), by `latest`.
digest() { (cd "$1/checkpoints" && cat "$(cat latest)"/*.safetensors | sha256sum | cut -d' ' -f1); }
complete() { find D/checkpoints -mindepth 1 -maxdepth 1 -name 'step-*' ! -name '*.tmp-*' ! -name '*.old-*' 2>/dev/null | sort; }

on2 0 "" train "${args[@]}" --out ref >/dev/null 2>err || { cat err; fail "the reference run failed"; }
ref=$(digest ref)
[ "$(cat ref/checkpoints/latest)" == step-00000006 ] || fail "the reference run did not end at step 6"
ls ref/checkpoints/step-00000006 | grep -q '^shard-0001.model.safetensors$' || fail "the reference run is not sharded"

kills=0 during_save=0 fresh=0 unreached=0
for victim in 0 1; do
  rm -rf C
  on2 "$victim" "SIGMA_KILL_COUNT=$W/count" train "${args[@]}" --out C >/dev/null 2>err || { cat err; fail "the counting run failed"; }
  points=$(cat count)
  ((points > 0 && points < 2000)) || fail "rank $victim: the shim counted $points points"
  stride=$(((points + MAX - 1) / MAX))
  echo "rank $victim makes $points disk-changing calls; killing it before 1 in $stride of them"
  for ((k = 1; k <= points; k += stride)); do
    rm -rf D
    rc=0
    on2 "$victim" "SIGMA_KILL_AT=$k" train "${args[@]}" --out D >/dev/null 2>err || rc=$?
    if ((rc == 0)); then  # the call count varies a little from run to run (a late point may not come)
      [ "$(digest D)" == "$ref" ] || fail "rank $victim point $k: not killed, and its end differs from the reference"
      unreached=$((unreached + 1))
      ((k > points / 2)) || { cat err; fail "rank $victim point $k: the run was not killed"; }
      continue
    fi
    kills=$((kills + 1))
    ls D/checkpoints 2>/dev/null | grep -q '\.tmp-' && during_save=$((during_save + 1))
    for ck in $(complete); do  # every committed checkpoint is whole: all ranks' files, checked
      "$SIGMA" inspect --ckpt "$ck" >/dev/null 2>err || { cat err; fail "rank $victim point $k: $ck does not open"; }
    done
    if [ -n "$(complete)" ]; then
      on2 0 "" train --quiet --resume D/checkpoints --out D >/dev/null 2>err || { cat err; fail "rank $victim point $k: the resume failed"; }
    else
      fresh=$((fresh + 1))
      on2 0 "" train "${args[@]}" --overwrite --out D >/dev/null 2>err || { cat err; fail "rank $victim point $k: the rerun failed"; }
    fi
    [ "$(digest D)" == "$ref" ] || fail "rank $victim point $k: the resumed run differs from the uninterrupted run"
    [ -z "$(ls D/checkpoints | grep -e '\.tmp-' -e '\.old-')" ] || fail "rank $victim point $k: temporaries left: $(ls D/checkpoints)"
  done
done
((during_save > 0)) || fail "no kill landed during a save"
echo "sharded saves (ckpt_async=$ASYNC): $kills kills ($during_save during a save, $fresh before the first commit); every committed checkpoint opened and every resume ended bit-identical; $unreached late points not reached"
