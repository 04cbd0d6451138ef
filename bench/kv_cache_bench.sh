#!/usr/bin/env bash
# Long-context batch-1 decode through an fp32 KV cache against a bf16 one (`sigma generate
# --kv-cache`; issue 40): a dense d=512, 8-block model of context CONTEXT (default 2048) decodes
# CONTEXT - 8 greedy tokens after a 3-token prompt with fp32, bf16 and int8 weights, the two
# cache types alternating within each round (which runs first alternates between rounds),
# with the memory bandwidth read (bench/stream_probe.cpp) at the start of each round; medians
# of ROUNDS. Speed does not depend on the weights, so the model is trained for 2 steps.
#
# A decode step at position p streams the weights and the cached keys and values of p
# positions (blocks x 2 x d x p values; attention reads them all). The bytes a token reads are
# the weights (`sigma generate` prints them) plus that, averaged over the run's positions;
# "of bound" = tokens/s x those bytes / the read bandwidth (the best of stream_probe's four
# reads). Also printed: whether both caches generated the same tokens (greedy: the bf16
# cache rounds keys and values, so the two may part where two logits nearly tie).
#
#   bench/kv_cache_bench.sh [BUILD_DIR=build] [ROUNDS=3] [CONTEXT=2048]
# Environment: KV_BENCH_DIR (work folder, default /tmp/sigma-kv-bench), NICE (prefix of each
# timed command, default "nice -n -19" when root).
set -euo pipefail
build=${1:-build}
rounds=${2:-3}
context=${3:-2048}
here=$(cd "$(dirname "$0")" && pwd)
sigma="$build/sigma"
probe="$build/stream_probe"
work=${KV_BENCH_DIR:-/tmp/sigma-kv-bench}
if [ -z "${NICE+x}" ]; then
  if [ "$(id -u)" = 0 ]; then NICE="nice -n -19"; else NICE=""; fi
fi
export OMP_WAIT_POLICY=passive
for f in "$sigma" "$probe"; do
  [ -x "$f" ] || { echo "kv_cache_bench: $f not found (build with -DSIGMA_BENCH=ON)" >&2; exit 2; }
done
d=512 layers=8 tokens=$((context - 8))
mkdir -p "$work"
ckpt="$work/dense-$context/checkpoints"
if [ ! -d "$ckpt" ]; then
  "$sigma" train --quiet --set model.d_model=$d --set model.heads=8 --set model.layers=$layers \
    --set model.context="$context" --set model.rre_layers=0 --set train.steps=2 \
    --set train.batch=1 --set train.eval_rows=1 --out "$work/dense-$context" >/dev/null
fi
results="$work/results.jsonl"
: > "$results"
machine=$("$here/machine.sh")
load_before=$(cut -d' ' -f1-3 /proc/loadavg)

run() {  # precision kv round
  local err
  err=$($NICE "$sigma" generate --ckpt "$ckpt" --prompt "1 2 3" --max-new "$tokens" \
        --precision "$1" --kv-cache "$2" 2>&1 >"$work/out-$1-$2-$3.txt")
  echo "$err" | python3 -c '
import json, re, sys
m = re.search(r"(\d+) more tokens in [\d.]+ s \(([\d.]+) tokens/s, \w+ weights: ([\d.]+) MB a token.*?"
              r"(\w+) KV cache: ([\d.]+) MB", sys.stdin.read())
print(json.dumps({"precision": sys.argv[1], "kv": sys.argv[2], "round": int(sys.argv[3]),
                  "steps": int(m.group(1)), "tokens_per_s": float(m.group(2)),
                  "weight_bytes_per_token": float(m.group(3)) * 1e6, "cache_mb": float(m.group(5))}))
' "$1" "$2" "$3" >> "$results"
}

for r in $(seq 1 "$rounds"); do
  echo "kv_cache_bench: round $r of $rounds" >&2
  $NICE "$probe" --samples 5 | python3 -c '
import json, sys; r = json.loads(sys.stdin.read()); r["stream"] = 1; print(json.dumps(r))' >> "$results"
  if [ $((r % 2)) = 1 ]; then order="fp32 bf16"; else order="bf16 fp32"; fi
  for precision in fp32 bf16 int8; do
    for kv in $order; do run "$precision" "$kv" "$r"; done
  done
done

python3 - "$results" "$machine" "$load_before" "$(cut -d' ' -f1-3 /proc/loadavg)" "$work" \
  "$layers" "$d" <<'EOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
machine, work, layers, d = sys.argv[2], sys.argv[5], int(sys.argv[6]), int(sys.argv[7])
reads = ("read_gbs_1t", "read_gbs", "read_prefetched_gbs_1t", "read_prefetched_gbs")
streams = [r for r in rows if r.get("stream")]
bw = statistics.median(max(s[k] for k in reads) for s in streams) * 1e9
print(f"machine: {machine}; load average before {sys.argv[3]}, after {sys.argv[4]}; read bandwidth "
      f"{bw * 1e-9:.2f} GB/s (median of {len(streams)} rounds)")
print(f"{'weights':8} {'KV':5} {'tokens/s':>9} {'rounds':26} {'cache MB':>9} {'MB/token':>9} {'of bound':>8}")
speed = {}
for prec in ("fp32", "bf16", "int8"):
    for kv in ("fp32", "bf16"):
        rs = [r for r in rows if r.get("precision") == prec and r.get("kv") == kv]
        tps = statistics.median(r["tokens_per_s"] for r in rs)
        speed[(prec, kv)] = [r["tokens_per_s"] for r in rs]
        steps = rs[0]["steps"]
        # Step k of the decode reads 3 + k positions (the prompt, the k - 1 before, its own).
        avg_positions = 3 + (steps + 1) / 2
        kv_bytes = layers * 2 * d * (4 if kv == "fp32" else 2) * avg_positions
        b = rs[0]["weight_bytes_per_token"] + kv_bytes
        print(f"{prec:8} {kv:5} {tps:9.1f} {str([round(r['tokens_per_s'], 1) for r in rs]):26} "
              f"{rs[0]['cache_mb']:9.1f} {b * 1e-6:9.1f} {tps * b / bw:8.1%}  [{machine}]")
for prec in ("fp32", "bf16", "int8"):
    ratios = [b / a for a, b in zip(speed[(prec, "fp32")], speed[(prec, "bf16")])]
    same = sum(open(f"{work}/out-{prec}-fp32-{r}.txt").read() == open(f"{work}/out-{prec}-bf16-{r}.txt").read()
               for r in range(1, len(ratios) + 1))
    print(f"{prec} weights: bf16 / fp32 KV cache tokens/s {statistics.median(ratios):.2f}x "
          f"(rounds {[round(x, 2) for x in ratios]}); the same tokens in {same} of {len(ratios)} rounds  [{machine}]")
EOF
