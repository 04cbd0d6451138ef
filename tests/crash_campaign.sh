#!/usr/bin/env bash
# Crash campaign (issue 15): SIGKILLs `sigma train` at random moments (during steps,
# checkpoint writes, ECSS store flushes, `latest` updates) and resumes, until the run
# finishes; then checks that every checkpoint ever left behind opened cleanly and that the
# final weights and optimizer state are bit-identical to an uninterrupted run's.
# Usage: tests/crash_campaign.sh SIGMA_BINARY TRIALS [SEED]   (ctest runs a few; docs/reliability.md
# records a 200-trial run). Trials alternate between the RAM and the file expert store.
set -euo pipefail
sigma=$1 trials=$2 seed=${3:-1}
RANDOM=$seed
work=$(mktemp -d "${TMPDIR:-/tmp}/sigma-crash-XXXXXX")
trap 'rm -rf "$work"' EXIT
args=(--quiet --set model.d_model=32 --set model.heads=2 --set model.layers=3 --set model.context=16
      --set train.batch=4 --set train.steps=12 --set train.ckpt_every=2 --set train.log_every=1
      --set train.eval_rows=4)

# The last checkpoint's tensors: model, optimizer and expert files (names and bytes).
digest() { (cd "$1" && cat "$(cat latest)"/*.safetensors | sha256sum | cut -d' ' -f1); }

# Whether ROOT holds a complete checkpoint (a killed first save leaves only NAME.tmp-<pid>).
has_checkpoint() {
  local d
  for d in "$1"/step-*; do
    [[ -f $d/manifest.json && $d != *.tmp-* && $d != *.old-* ]] && return 0
  done
  return 1
}

declare -A reference
for store in ram file; do
  # The store's path is part of the config saved in the checkpoint: the trials use the same one.
  extra=(); [[ $store == file ]] && extra=(--expert-store "$work/run.store")
  t0=$(date +%s%N)
  "$sigma" train "${args[@]}" "${extra[@]}" --out "$work/ref-$store" >/dev/null
  run_ms=$(( ($(date +%s%N) - t0) / 1000000 ))
  reference[$store]=$(digest "$work/ref-$store/checkpoints")
  rm -f "$work/run.store"
done

kills=0 opened=0
for ((t = 1; t <= trials; t++)); do
  store=$([[ $((t % 2)) == 0 ]] && echo file || echo ram)
  out="$work/run" st="$work/run.store"
  rm -rf "$out" "$st"
  extra=(); [[ $store == file ]] && extra=(--expert-store "$st")
  for ((attempt = 0; ; attempt++)); do
    if has_checkpoint "$out/checkpoints"; then
      cmd=("$sigma" train --quiet --resume "$out/checkpoints" --out "$out" "${extra[@]}")
    else  # killed before any checkpoint: nothing to resume, start again from scratch
      rm -f "$st"
      cmd=("$sigma" train "${args[@]}" "${extra[@]}" --overwrite --out "$out")
    fi
    "${cmd[@]}" >/dev/null 2>"$work/err" &
    pid=$!
    # Kill at a random moment of a run's length, except every 6th attempt, which may finish.
    if ((attempt % 6 != 5)); then
      ms=$(( (RANDOM * 32768 + RANDOM) % (run_ms + 1) ))
      sleep "$((ms / 1000)).$(printf %03d $((ms % 1000)))"
      kill -9 "$pid" 2>/dev/null || true
    fi
    rc=0
    wait "$pid" 2>/dev/null || rc=$?
    ((rc == 0)) && break
    if ((rc != 137)); then  # not our SIGKILL: a real error
      echo "trial $t attempt $attempt: sigma train exited $rc:" >&2; cat "$work/err" >&2; exit 1
    fi
    kills=$((kills + 1))
    # Every complete checkpoint left behind must open (checksums, shapes, finite weights).
    for ck in "$out"/checkpoints/step-*; do
      [[ -d $ck && $ck != *.tmp-* && $ck != *.old-* ]] || continue
      "$sigma" inspect --ckpt "$ck" >/dev/null 2>"$work/err" || {
        echo "trial $t: checkpoint $ck does not open:" >&2; cat "$work/err" >&2; exit 1; }
      opened=$((opened + 1))
    done
  done
  got=$(digest "$out/checkpoints")
  if [[ $got != "${reference[$store]}" ]]; then
    echo "trial $t ($store store): final checkpoint differs from the uninterrupted run" >&2
    exit 1
  fi
done
echo "crash campaign: $trials trials, $kills kills, $opened checkpoint opens, all resumed bit-identically"
