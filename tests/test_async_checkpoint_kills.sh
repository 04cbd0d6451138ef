#!/usr/bin/env bash
# Kill campaign against background checkpoints (train.ckpt_async, issue 37 item 10): a run
# saving every 2 steps (ECSS experts, retention on) is SIGKILLed just before its Nth
# disk-changing call (tests/kill_at.cpp), for N over every point of the run (at most MAX of
# them, evenly spread): the writer thread's files, renames and `latest` while the next steps
# run, retention's deletions, the summary. After each kill every complete checkpoint left must
# open (sizes, checksums, shapes), and a resume from the newest (or a fresh start when none
# was committed) must end with checkpoints bit-identical to an uninterrupted run's.
# Usage: test_async_checkpoint_kills.sh SIGMA KILL_AT_SHIM [MAX]   (~1 s per point)
set -euo pipefail
SIGMA=$(realpath "$1")
SHIM=$(realpath "$2")
MAX=${3:-40}
W=$(mktemp -d "${TMPDIR:-/tmp}/sigma-async-kills-XXXXXX")
trap 'rm -rf "$W"' EXIT
cd "$W"
export OMP_WAIT_POLICY=passive OMP_NUM_THREADS=1
args=(--quiet --set model.d_model=32 --set model.heads=2 --set model.layers=3 --set model.context=16
      --set train.batch=4 --set train.steps=6 --set train.ckpt_every=2 --set train.log_every=1
      --set train.eval_rows=4 --set train.keep_checkpoints=2 --set train.ckpt_async=true)
fail() { echo "FAIL: $*"; ls -laR D 2>/dev/null | head -60; exit 1; }

# The newest checkpoint's tensors (model, optimizer, expert groups), by `latest`.
digest() { (cd "$1/checkpoints" && cat "$(cat latest)"/*.safetensors | sha256sum | cut -d' ' -f1); }
# The complete checkpoints of a run (a killed save leaves NAME.tmp-<pid> or NAME.old-<pid>).
complete() { find D/checkpoints -mindepth 1 -maxdepth 1 -name 'step-*' ! -name '*.tmp-*' ! -name '*.old-*' 2>/dev/null | sort; }

SIGMA_KILL_COUNT="$W/count" LD_PRELOAD="$SHIM" "$SIGMA" train "${args[@]}" --out ref >/dev/null
points=$(cat count)
ref=$(digest ref)
[ "$(cat ref/checkpoints/latest)" == step-00000006 ] || fail "the reference run did not end at step 6"
((points > 20 && points < 2000)) || fail "the shim counted $points points"
stride=$(((points + MAX - 1) / MAX))
echo "a run saving in the background makes $points disk-changing calls; killing before 1 in $stride of them"

kills=0 during_save=0 fresh=0
for ((k = 1; k <= points; k += stride)); do
  rm -rf D
  rc=0
  SIGMA_KILL_AT=$k LD_PRELOAD="$SHIM" "$SIGMA" train "${args[@]}" --out D >/dev/null 2>err & wait $! 2>/dev/null || rc=$?
  ((rc == 137)) || { cat err; fail "point $k: the run exited $rc, not killed"; }
  kills=$((kills + 1))
  ls D/checkpoints 2>/dev/null | grep -q '\.tmp-' && during_save=$((during_save + 1))
  for ck in $(complete); do  # every committed checkpoint is whole
    "$SIGMA" inspect --ckpt "$ck" >/dev/null 2>err || { cat err; fail "point $k: $ck does not open"; }
  done
  if [ -n "$(complete)" ]; then
    "$SIGMA" inspect --ckpt D/checkpoints >/dev/null 2>err || { cat err; fail "point $k: the newest checkpoint does not open"; }
    "$SIGMA" train --quiet --resume D/checkpoints --out D >/dev/null 2>err || { cat err; fail "point $k: the resume failed"; }
  else
    fresh=$((fresh + 1))
    "$SIGMA" train "${args[@]}" --overwrite --out D >/dev/null 2>err || { cat err; fail "point $k: the rerun failed"; }
  fi
  [ "$(digest D)" == "$ref" ] || fail "point $k: the resumed run differs from the uninterrupted run"
  [ -z "$(ls D/checkpoints | grep -e '\.tmp-' -e '\.old-')" ] || fail "point $k: temporaries left: $(ls D/checkpoints)"
done
((during_save > 0)) || fail "no kill landed during a save"
echo "background saves: $kills kills ($during_save during a save, $fresh before the first commit); every committed checkpoint opened and every resume ended bit-identical"
