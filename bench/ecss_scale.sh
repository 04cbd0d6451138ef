#!/usr/bin/env bash
# ECSS at real scale through `sigma train` (issue 16; docs/benchmarks.md, "ECSS at real scale").
# A 2.97 B-parameter mixed model (d=512, 4 blocks of which the top 2 are RRE, four groups of K
# experts, 4k vocabulary) trained on the six domains of ../shared/data with the default sampler,
# its experts in a store file (or RAM), under train.expert_memory. Prints per-step seconds and
# tokens/s from the progress lines, and samples the process: peak anonymous and file-backed
# resident memory (/proc/PID/status) and the bytes it read and wrote (/proc/PID/io).
#
#   bench/ecss_scale.sh [--experts 176] [--steps 6] [--accum 1] [--batch 8]
#                       [--store /var/tmp/ecss-scale.bin | --store ram] [--budget auto]
#                       [--work runs/ecss-scale] [--keep-store] [--set key=value ...]
#                       [--sigma build/sigma]
#
# The first run prepares the data in --work (corpus split, a 4,096-token tokenizer, shards).
# The run's summary.json gives the ECSS counters (gathers, bytes gathered and updated per step);
# its output folder, with the final checkpoint, is deleted afterwards. --sigma: another binary
# (a before/after comparison).
set -euo pipefail
cd "$(dirname "$0")/.."

experts=176 steps=6 accum=1 batch=8 store=/var/tmp/ecss-scale.bin budget=auto
work=runs/ecss-scale keep=0 corpus=../shared/data/corpus sigma=./build/sigma
sets=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --experts) experts=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --accum) accum=$2; shift 2 ;;
    --batch) batch=$2; shift 2 ;;
    --store) store=$2; shift 2 ;;
    --budget) budget=$2; shift 2 ;;
    --work) work=$2; shift 2 ;;
    --keep-store) keep=1; shift ;;
    --set) sets+=(--set "$2"); shift 2 ;;
    --sigma) sigma=$2; shift 2 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
[[ -x $sigma ]] || { echo "build first: $sigma is missing" >&2; exit 1; }

# ---- data: once ------------------------------------------------------------------------------
if [[ ! -f $work/shards/manifest.json ]]; then
  mkdir -p "$work"
  for d in english chinese poetry bilingual python java; do
    mkdir -p "$work/corpus/$d"
    cp "$corpus/$d/train.jsonl" "$work/corpus/$d/train.jsonl"
  done
  $sigma tokenizer train --corpus "$work/corpus" --vocab-size 4096 --out "$work/tok4k.json"
  cat > "$work/prepare.json" <<EOF
{"tokenizer": "tok4k.json", "corpus": ["corpus"],
 "domains": [{"name": "english", "group": "en", "slot": 0},
             {"name": "chinese", "group": "zh", "slot": 0},
             {"name": "poetry", "group": "zh", "slot": 0},
             {"name": "bilingual", "group": "enzh", "slot": 0, "format": "bilingual"},
             {"name": "python", "group": "code", "slot": 0},
             {"name": "java", "group": "code", "slot": 0}]}
EOF
  $sigma prepare --config "$work/prepare.json" --out "$work/shards"
fi

cat > "$work/train.json" <<EOF
{"model": {"d_model": 512, "heads": 8, "layers": 4, "context": 128, "rre_layers": 2,
           "groups": [{"name": "en", "experts": $experts}, {"name": "zh", "experts": $experts},
                      {"name": "enzh", "experts": $experts}, {"name": "code", "experts": $experts}]},
 "optim": {"lr": 0.0005, "warmup": 2},
 "train": {"steps": $steps, "batch": $batch, "accum": $accum, "log_every": 1, "eval_rows": 8,
           "expert_memory": "$budget"},
 "data": {"source": "shards", "path": "$work/shards"}}
EOF

store_args=()
if [[ $store != ram ]]; then
  rm -f "$store"
  store_args=(--expert-store "$store")
fi

log=$(mktemp) samples=$(mktemp) out=$(mktemp -d "$work/out.XXXXXX")
trap 'rm -rf "$log" "$samples" "$out"; [[ $keep == 1 || $store == ram ]] || rm -f "$store"' EXIT
start=$(date +%s.%N)
"$sigma" train --config "$work/train.json" --out "$out" --overwrite "${store_args[@]}" "${sets[@]}" 2> >(
  while IFS= read -r line; do printf '%s %s\n' "$(date +%s.%N)" "$line"; done > "$log") &
pid=$!
# Sample memory once a second; I/O counters at the end of each sample.
while kill -0 $pid 2>/dev/null; do
  { printf '%s ' "$(date +%s.%N)"
    awk '/^RssAnon|^RssFile/ {printf "%s %s ", $1, $2}' /proc/$pid/status
    awk '/^read_bytes|^write_bytes/ {printf "%s %s ", $1, $2}' /proc/$pid/io
    echo; } >> "$samples" 2>/dev/null || true
  sleep 1
done
status=0
wait $pid || status=$?
end=$(date +%s.%N)
sleep 0.2
if [[ $status != 0 ]]; then  # the steps already run are still reported below
  echo "ecss_scale: sigma train exited with status $status; its last lines:"
  tail -n 5 "$log" | cut -d' ' -f2-
fi

grep -v '^[0-9.]* step ' "$log" | cut -d' ' -f2- | head -n 8
python3 - "$log" "$samples" "$batch" "$accum" "$start" "$end" "$out/summary.json" <<'EOF'
import json, os, re, statistics, sys
log, samples, batch, accum, start, end, summary = sys.argv[1:]
tokens = int(batch) * int(accum) * 128
t = [float(l.split()[0]) for l in open(log) if re.search(r' step +\d+/', l)]
steps = [b - a for a, b in zip(t, t[1:])]
anon = file_ = 0
io = []  # (time, read, written)
for l in open(samples):
    f = l.split()
    if len(f) < 3: continue
    d = dict(zip(f[1::2], f[2::2]))
    anon = max(anon, int(d.get('RssAnon:', 0)))
    file_ = max(file_, int(d.get('RssFile:', 0)))
    if 'read_bytes:' in d: io.append((float(f[0]), int(d['read_bytes:']), int(d['write_bytes:'])))
def io_at(when):  # the last sample before `when`
    before = [x for x in io if x[0] <= when]
    return before[-1] if before else (when, 0, 0)
print(f"steps timed (after the first): {len(steps)}; seconds each: " + " ".join(f"{s:.1f}" for s in steps))
if steps:
    med = statistics.median(steps)
    print(f"median step {med:.2f} s = {tokens / med:.0f} tokens/s ({tokens} tokens a step)")
print(f"peak RssAnon {anon / 1048576:.2f} GiB, peak RssFile {file_ / 1048576:.2f} GiB")
if len(t) >= 2:
    a, b = io_at(t[0]), io_at(t[-1])
    n = len(t) - 1
    print(f"process I/O per step (steps 2..{len(t)}): read {(b[1] - a[1]) / n / 2**30:.2f} GiB, "
          f"wrote {(b[2] - a[2]) / n / 2**30:.2f} GiB")
print(f"whole run {float(end) - float(start):.0f} s (store creation and evaluation included)")
e = json.load(open(summary)).get("ecss") if os.path.exists(summary) else None
if e:
    print(f"ECSS per step (all steps): {e['pieces_per_step']:.1f} gathers, gathered "
          f"{e['gathered_gib_per_step']:.3f} GiB, records updated {e['records_gib_per_step']:.3f} GiB; "
          f"compute buffer {e['compute_buffer_mib']:.0f} MiB")
EOF
exit $status
