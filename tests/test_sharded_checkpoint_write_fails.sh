#!/usr/bin/env bash
# A sharded save whose write fails on one rank (a full disk for that rank's files: the shim
# tests/kill_at.cpp with SIGMA_FAIL_OPEN makes its write-opens fail with ENOSPC), under mpirun:
# tp 2 on 2 ranks, expert parallel. A run saved step 2; resumed with rank 1's shard files
# refused, its save at step 4 must fail on every rank, each saying so and naming the failed
# rank's shard (rank 1 also its file and the cause), commit nothing (latest stays step 2, no
# step-4 directory, no temporary left), and leave step 2 intact: it opens, and a resume from
# it ends with the uninterrupted run's files. ASYNC (train.ckpt_async, default true): with
# true the save is written in the background and its failure is found when the ranks agree on
# it at a later step boundary (or the end of the run); the same outcome is required.
# Usage: test_sharded_checkpoint_write_fails.sh SIGMA SHIM [ASYNC]
set -euo pipefail
SIGMA=$(realpath "$1")
SHIM=$(realpath "$2")
ASYNC=${3:-true}
command -v mpirun >/dev/null || { echo "SKIP: no mpirun"; exit 0; }
W=$(mktemp -d "${TMPDIR:-/tmp}/sigma-shard-enospc-XXXXXX")
trap 'rm -rf "$W"' EXIT
cd "$W"
export OMP_WAIT_POLICY=passive OMP_NUM_THREADS=1
args=(--quiet --set model.d_model=32 --set model.heads=2 --set model.layers=3 --set model.context=16
      --set train.batch=4 --set train.accum=2 --set train.steps=6 --set train.ckpt_every=2
      --set train.log_every=1 --set train.eval_rows=4 --set dist.tp=2 --set dist.timeout_s=30
      --set train.ckpt_async="$ASYNC")
mpi=(mpirun --allow-run-as-root --oversubscribe --bind-to none -np 2)
fail() { echo "FAIL: $*"; ls -laR D 2>/dev/null | head -60; exit 1; }
# Runs sigma on 2 ranks; rank 1 gets the shim with the environment in $1 (empty: none).
on2() {
  local env=$1
  shift
  "${mpi[@]}" bash -c "if [ \"\$OMPI_COMM_WORLD_RANK\" = 1 ] && [ -n '$env' ]; then export LD_PRELOAD='$SHIM' $env; fi; exec \"\$@\"" \
    _ "$SIGMA" "$@"
}
digest() { (cd "$1/checkpoints" && cat "$(cat latest)"/*.safetensors | sha256sum | cut -d' ' -f1); }

on2 "" train "${args[@]}" --out ref >/dev/null 2>err || { cat err; fail "the reference run failed"; }
ls ref/checkpoints/step-00000006 | grep -q '^shard-0001.model.safetensors$' || fail "the reference run is not sharded"
on2 "" train "${args[@]}" --out D --stop-at 2 >/dev/null 2>err || { cat err; fail "the run to step 2 failed"; }
[ "$(cat D/checkpoints/latest)" == step-00000002 ] || fail "no step 2 checkpoint"
before=$(cd D/checkpoints/step-00000002 && sha256sum ./* | sha256sum)

rc=0
on2 "SIGMA_FAIL_OPEN=shard-0001." train --resume D/checkpoints --out D >out 2>&1 || rc=$?
((rc != 0)) || { cat out; fail "the run whose rank 1 cannot write ended with 0"; }
# Every rank says the save failed and names shard 1; rank 1 names its file and the cause.
n=$(grep -c 'checkpoint step-00000004 was not saved' out || true)
((n == 2)) || { cat out; fail "$n ranks of 2 reported the failed save"; }
grep -q 'the rank writing shard 1 of 2 (data rank 0, tp rank 1) could not write its files shard-0001.model.safetensors or shard-0001.adam.safetensors' out ||
  { cat out; fail "rank 0 does not name shard 1 and its files"; }
grep 'this rank (shard 1) could not write its files' out | grep -q 'shard-0001\.' || { cat out; fail "rank 1 does not name its file"; }
grep -q 'No space left on device' out || { cat out; fail "the cause (ENOSPC) is not said"; }
[ "$(cat D/checkpoints/latest)" == step-00000002 ] || fail "latest moved to $(cat D/checkpoints/latest)"
[ ! -e D/checkpoints/step-00000004 ] || fail "a step-4 checkpoint was committed"
[ -z "$(ls D/checkpoints | grep -e '\.tmp-' -e '\.old-')" ] || fail "temporaries left: $(ls D/checkpoints)"
[ "$(cd D/checkpoints/step-00000002 && sha256sum ./* | sha256sum)" == "$before" ] || fail "step 2's files changed"
"$SIGMA" inspect --ckpt D/checkpoints >/dev/null 2>err || { cat err; fail "step 2 does not open"; }
on2 "" train --quiet --resume D/checkpoints --out D >/dev/null 2>err || { cat err; fail "the resume from step 2 failed"; }
[ "$(digest D)" == "$(digest ref)" ] || fail "the resumed run differs from the uninterrupted run"
if [ "$ASYNC" == true ]; then  # the banner says where the saves are written
  grep -q 'checkpoints: written in the background' out || { cat out; fail "the save was not in the background"; }
else
  grep -q 'checkpoints: written in the background' out && { cat out; fail "the save was in the background"; }
fi
echo "ckpt_async=$ASYNC: a failed write on rank 1: both ranks reported it, nothing committed, step 2 intact and resumed bit-identically"
