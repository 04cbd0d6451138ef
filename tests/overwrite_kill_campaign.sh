#!/usr/bin/env bash
# Kill campaign against `sigma train --overwrite` (issue 37): OUT holds a finished run; a new
# run replaces it and is SIGKILLed just before its Nth disk-changing call (tests/kill_at.cpp),
# for every N from the first call to the last: setting the old run aside, the first metrics,
# every file and rename of the first checkpoint, `latest`, the old run's deletion, the summary.
# After each kill the next start in OUT (a plain start, refused because OUT holds a run) must
# find either the old run byte-identical or the new run's committed checkpoint, never neither,
# and nothing set aside left behind. Every 8th point the --overwrite is then rerun and must
# finish with the uninterrupted run's checkpoint.
# Usage: overwrite_kill_campaign.sh SIGMA KILL_AT_SHIM   (bounded: ~0.3 s per point)
set -euo pipefail
SIGMA=$(realpath "$1")
SHIM=$(realpath "$2")
W=$(mktemp -d "${TMPDIR:-/tmp}/sigma-overwrite-kills-XXXXXX")
trap 'rm -rf "$W"' EXIT
cd "$W"
export OMP_WAIT_POLICY=passive OMP_NUM_THREADS=1
tiny=(--quiet --set model.d_model=16 --set model.layers=2 --set model.heads=2 --set model.context=8
      --set train.batch=2 --set train.eval_rows=4)
new_run=("$SIGMA" train "${tiny[@]}" --set train.steps=3 --set train.ckpt_every=3
         --set train.log_every=1 --set train.seed=7 --overwrite --out D)
fail() { echo "FAIL: $*"; ls -laR D 2>/dev/null | head -40; exit 1; }

# Every file under a run (but the lock) with its bytes.
tree() { (cd "$1" && find . -type f ! -name .lock | LC_ALL=C sort | xargs -r sha256sum); }
# The newest checkpoint's tensors (`latest`'s, or the complete one a kill left unnamed).
digest() {
  local n
  n=$(cat "$1/checkpoints/latest" 2>/dev/null) ||
    n=$(cd "$1/checkpoints" && ls -d step-* | grep -v -e '\.tmp-' -e '\.old-' | tail -1)
  (cd "$1/checkpoints/$n" && cat ./*.safetensors | sha256sum | cut -d' ' -f1)
}

"$SIGMA" train "${tiny[@]}" --set train.steps=4 --set train.ckpt_every=2 --set train.log_every=2 \
  --out old >/dev/null
old_tree=$(tree old)
rm -rf D && cp -a old D
SIGMA_KILL_COUNT="$W/count" LD_PRELOAD="$SHIM" "${new_run[@]}" >/dev/null
points=$(cat count)
new_digest=$(digest D)
((points > 10 && points < 2000)) || fail "the shim counted $points points"
echo "an --overwrite run makes $points disk-changing calls; killing before each"

kept_old=0 kept_new=0
for ((k = 1; k <= points; k++)); do
  rm -rf D && cp -a old D
  rc=0
  SIGMA_KILL_AT=$k LD_PRELOAD="$SHIM" "${new_run[@]}" >/dev/null 2>err & wait $! 2>/dev/null || rc=$?
  ((rc == 137)) || { cat err; fail "point $k: the run exited $rc, not killed"; }
  # The next start in OUT recovers it; a plain start is then refused (OUT holds a run).
  if "$SIGMA" train "${tiny[@]}" --set train.steps=1 --out D >/dev/null 2>err; then
    fail "point $k: after the kill OUT held no run at all"
  fi
  grep -q "already holds a training run" err || { cat err; fail "point $k: the next start failed"; }
  [ -z "$(ls -A D | grep -e '^\.replaced-' -e '^\.dropped-')" ] ||
    fail "point $k: a set-aside run is left: $(ls -A D)"
  if [ "$(tree D)" == "$old_tree" ]; then
    kept_old=$((kept_old + 1))
  else
    # Otherwise the new run must have committed its checkpoint, and nothing of the old is left.
    "$SIGMA" inspect --ckpt D/checkpoints >/dev/null 2>err ||
      { cat err; fail "point $k: neither the old run nor a complete new checkpoint"; }
    [ "$(digest D)" == "$new_digest" ] || fail "point $k: neither the old run intact nor the new run's checkpoint"
    [ ! -e D/checkpoints/step-00000004 ] && [ ! -e D/checkpoints/step-00000002 ] ||
      fail "point $k: old checkpoints mixed with the new run's"
    kept_new=$((kept_new + 1))
  fi
  if ((k % 8 == 0)); then
    "${new_run[@]}" >/dev/null 2>err || { cat err; fail "point $k: the rerun failed"; }
    [ "$(digest D)" == "$new_digest" ] || fail "point $k: the rerun differs from an uninterrupted run"
  fi
done
((kept_new > 0 && kept_old > 0)) || fail "the kills never reached past the commit (old $kept_old, new $kept_new)"
echo "overwrite: $points kills; the old run intact after $kept_old, the new run's checkpoint after $kept_new, nothing lost"
