#!/usr/bin/env bash
# Background sharded saves under mpirun (train.ckpt_async, issue 38): tp 2 on 2 ranks, saving
# every 2 steps of 8, rank 1's shard files on a slow disk (the shim tests/kill_at.cpp with
# SIGMA_SLOW_OPEN: each write-open sleeps). In the background the next steps run while the
# files are written (summary.json's background_saves.steps_overlapped > 0), a save that comes
# before the last one is committed waits for it (counted, and said on stderr), and the run's
# checkpoints hold the foreground run's tensors bit for bit. In the foreground nothing overlaps.
# Usage: test_sharded_async_overlap.sh SIGMA SHIM
set -euo pipefail
SIGMA=$(realpath "$1")
SHIM=$(realpath "$2")
command -v mpirun >/dev/null || { echo "SKIP: no mpirun"; exit 0; }
W=$(mktemp -d "${TMPDIR:-/tmp}/sigma-shard-overlap-XXXXXX")
trap 'rm -rf "$W"' EXIT
cd "$W"
export OMP_WAIT_POLICY=passive OMP_NUM_THREADS=1
args=(--set model.d_model=32 --set model.heads=2 --set model.layers=3 --set model.context=16
      --set train.batch=4 --set train.accum=2 --set train.steps=8 --set train.ckpt_every=2
      --set train.log_every=1 --set train.eval_rows=4 --set dist.tp=2 --set dist.timeout_s=60)
mpi=(mpirun --allow-run-as-root --oversubscribe --bind-to none -np 2)
fail() { echo "FAIL: $*"; exit 1; }
# Runs sigma on 2 ranks, rank 1's shard files slowed (300 ms per file).
slow2() {
  "${mpi[@]}" bash -c "if [ \"\$OMPI_COMM_WORLD_RANK\" = 1 ]; then export LD_PRELOAD='$SHIM' SIGMA_SLOW_OPEN=shard-0001. SIGMA_SLOW_MS=300; fi; exec \"\$@\"" \
    _ "$SIGMA" "$@"
}
saves() { python3 -c "import json,sys; print(json.dumps(json.load(open(sys.argv[1])).get('background_saves')))" "$1/summary.json"; }
# Every tensor of checkpoint $1 equals checkpoint $2's (the config in the metadata aside:
# train.ckpt_async differs).
same_tensors() {
  python3 - "$1" "$2" <<'PY'
import json, os, struct, sys
def load(p):
    b = open(p, "rb").read(); n = struct.unpack("<Q", b[:8])[0]
    h = json.loads(b[8:8 + n]); m = h.pop("__metadata__", {}); m.pop("config", None)
    return h, m, b[8 + n:]
files = sorted(f for f in os.listdir(sys.argv[1]) if f.endswith(".safetensors"))
assert files == sorted(f for f in os.listdir(sys.argv[2]) if f.endswith(".safetensors")), "other files"
bad = [f for f in files if load(os.path.join(sys.argv[1], f)) != load(os.path.join(sys.argv[2], f))]
sys.exit(f"tensors differ in {bad}" if bad else 0)
PY
}

slow2 train "${args[@]}" --set train.ckpt_async=true --out bg >bg.log 2>&1 || { cat bg.log; fail "the background run failed"; }
slow2 train "${args[@]}" --set train.ckpt_async=false --out fg >fg.log 2>&1 || { cat fg.log; fail "the foreground run failed"; }
grep -q 'checkpoints: written in the background' bg.log || { cat bg.log; fail "the saves were not in the background"; }
# The banner states the copy each rank keeps: the largest rank's shard files, to 2 %.
python3 - bg.log bg/checkpoints/step-00000008 <<'PY' || fail "the banner's copy size is not the largest rank's shard files"
import os, re, sys
m = re.search(r"Adam state, ([\d.]+) MiB on the most loaded rank", open(sys.argv[1]).read())
assert m, "no copy size in the banner"
ranks = {}
for f in os.listdir(sys.argv[2]):
    if f.startswith("shard-"):
        ranks[f[:10]] = ranks.get(f[:10], 0) + os.path.getsize(os.path.join(sys.argv[2], f))
said, largest = float(m.group(1)), max(ranks.values()) / 2**20
print(f"banner {said} MiB, largest rank's shard files {largest:.1f} MiB")
sys.exit(0 if abs(said - largest) <= 0.02 * largest else 1)
PY
read -r overlapped waits n < <(python3 -c "import json,sys; b=json.load(open(sys.argv[1]))['background_saves']; print(b['steps_overlapped'], b['waits'], b['saves'])" bg/summary.json)
((n == 4)) || fail "background: $n saves, not 4"
((overlapped > 0)) || fail "background: no step ran while a save was written ($(saves bg))"
((waits > 0)) || fail "background: no save waited for the one before, though each takes 600 ms ($(saves bg))"
grep -q 'waited .* for the previous background save' bg.log || { cat bg.log; fail "the wait is not said"; }
[ "$(saves fg)" == null ] || fail "foreground: background saves reported: $(saves fg)"
for s in 2 4 6 8; do
  c=checkpoints/step-0000000$s
  same_tensors "bg/$c" "fg/$c" || fail "step $s: the background checkpoint's tensors differ from the foreground one's"
done
[ "$(cat bg/checkpoints/latest)" == step-00000008 ] || fail "background: latest is $(cat bg/checkpoints/latest)"
[ -z "$(ls bg/checkpoints | grep -e '\.tmp-' -e '\.old-')" ] || fail "temporaries left: $(ls bg/checkpoints)"
echo "background sharded saves: $overlapped steps ran during a save, $waits saves waited for the one before; every checkpoint holds the foreground run's tensors"
