#!/usr/bin/env bash
# Batch-1 decode benchmark (issues 12 and 27; docs/benchmarks.md "Serving: batch-1 decode"):
# Sigma fp32, bf16 and int8 weights (`sigma generate --precision`) against the PyTorch peer with
# a KV cache (bench/torch_decode.py, fp32 and bf16) on the same shapes, and the memory bandwidth
# measured in the same run (bench/stream_probe.cpp), alternating within each round; medians of
# ROUNDS. For Sigma also the weight bytes the model holds after loading (Model::held_bytes:
# the converted matrices, their scales, the fp32 rest; no gradient, no fp32 copy) and the
# process's resident set at the end, both as `sigma generate` prints them.
#
# Models: a dense d=512, 8-block model, and an extracted sub-model (`sigma extract --domain copy`)
# of a sparse model with the same trunk and 4 RRE blocks (groups of 2, 3 and 4 experts); both
# trained for 2 steps on the synthetic data (speed does not depend on the weights), whose
# vocabulary is 32 tokens. A third, dense16k, is the dense model with the vocabulary of the
# tokenizer trained on ../shared/data (16,384; docs/data.md): its tied head is a quarter of a
# token's weights, read row by row (the head's kernels), as on a model of real text.
#
# Each run decodes TOKENS greedy tokens after a 3-token prompt, with the defaults (`--kv-cache
# auto`: an fp32 cache with fp32 weights, a bf16 one with bf16 and int8, as the peer caches in
# its weights' type; the table names it); tokens/s counts the decode steps after the first
# token. The bound: bytes of weights one token reads (every matrix, one expert
# per RRE block, the tied head, biases; `sigma generate` prints its count, the peer its own) /
# the read bandwidth, median over the rounds of the best of four reads: 1 and 2 threads, a
# plain loop and one with software prefetch into L2 as the GEMV kernel streams (on this
# machine the prefetched read is ~1.2x the plain one, so the plain read alone understates the
# bound). Fraction of the bound = tokens/s x bytes per token / bandwidth. Each round also
# streams the same matrices through the GEMV kernels and oneDNN alone (bench/bench_gemv.cpp), on
# huge pages as the model holds its weights (Model::use_weights).
#
# Every figure is printed with the machine kind (bench/machine.sh: CPU family/model and ISA) and
# the instruction set the GEMV kernels ran on (bench_gemv's "isa"), with the load average. Where
# /usr/bin/python3 cannot import torch the peer is skipped (said so) and Sigma alone is measured.
#
#   bench/decode_bench.sh [BUILD_DIR=build] [ROUNDS=3] [TOKENS=250]
# Environment: DECODE_BENCH_DIR (work folder, default /tmp/sigma-decode-bench), NICE (prefix
# of each timed command, default "nice -n -19" when root), PYTHON (default /usr/bin/python3).
set -euo pipefail
build=${1:-build}
rounds=${2:-3}
tokens=${3:-250}
here=$(cd "$(dirname "$0")" && pwd)
sigma="$build/sigma"
probe="$build/stream_probe"
kernel="$build/bench_gemv"
python=${PYTHON:-/usr/bin/python3}
work=${DECODE_BENCH_DIR:-/tmp/sigma-decode-bench}
if [ -z "${NICE+x}" ]; then
  if [ "$(id -u)" = 0 ]; then NICE="nice -n -19"; else NICE=""; fi
fi
export OMP_WAIT_POLICY=passive
for f in "$sigma" "$probe" "$kernel"; do
  [ -x "$f" ] || { echo "decode_bench: $f not found (build with -DSIGMA_BENCH=ON)" >&2; exit 2; }
done
mkdir -p "$work"
results="$work/results.jsonl"
: > "$results"
machine=$("$here/machine.sh")
load_before=$(cut -d' ' -f1-3 /proc/loadavg)
peer=1
if ! "$python" -c 'import torch' 2>/dev/null; then
  peer=0
  echo "decode_bench: $python cannot import torch: the PyTorch peer is skipped" >&2
fi

trunk=(--set model.d_model=512 --set model.heads=8 --set model.layers=8 --set model.context=256
       --set train.steps=2 --set train.batch=2 --set train.eval_rows=2)
if [ ! -d "$work/dense/checkpoints" ]; then
  "$sigma" train --quiet "${trunk[@]}" --set model.rre_layers=0 --out "$work/dense" >/dev/null
fi
if [ ! -d "$work/dense16k/checkpoints" ]; then
  "$sigma" train --quiet "${trunk[@]}" --set model.rre_layers=0 --set model.vocab=16384 \
      --out "$work/dense16k" >/dev/null
fi
if [ ! -d "$work/extract" ]; then
  "$sigma" train --quiet "${trunk[@]}" --set model.rre_layers=4 --out "$work/sparse" >/dev/null
  "$sigma" extract --ckpt "$work/sparse/checkpoints" --domain copy --out "$work/extract" >/dev/null
fi
# The peer's shapes: vocabulary 32 (the synthetic data's), the extract's group has 3 experts.
peer_dense=(--d 512 --heads 8 --layers 8 --vocab 32 --context 256)
peer_extract=("${peer_dense[@]}" --rre-layers 4 --experts 3)
peer_dense16k=(--d 512 --heads 8 --layers 8 --vocab 16384 --context 256)
models=(dense extract dense16k)

run_sigma() {  # model precision
  local ckpt="$work/$1/checkpoints"
  [ "$1" = extract ] && ckpt="$work/extract"
  local err
  err=$($NICE "$sigma" generate --ckpt "$ckpt" --prompt "1 2 3" --max-new "$tokens" \
        --precision "$2" 2>&1 >/dev/null)
  echo "$err" | "$python" -c '
import json, re, sys
m = re.search(r"\(([\d.]+) tokens/s, \w+ weights: ([\d.]+) MB a token.*?([\d.]+) MB of weights "
              r"held, (\w+) KV cache.*?([\d.]+) MB resident", sys.stdin.read())
print(json.dumps({"impl": "sigma", "model": sys.argv[1], "precision": sys.argv[2], "round": int(sys.argv[3]),
                  "tokens_per_s": float(m.group(1)), "weight_bytes_per_token": float(m.group(2)) * 1e6,
                  "held_bytes": float(m.group(3)) * 1e6, "kv_cache": m.group(4),
                  "resident_bytes": float(m.group(5)) * 1e6}))
' "$1" "$2" "$r" >> "$results"
}

# The read bound right before and after a model's Sigma runs (2 s each): the VM's memory
# bandwidth moves by up to ~30 % within minutes (47-66 GB/s on one quiet Zen 5), so the round's
# first probe can be minutes away from the run it bounds.
probe_near() {  # model
  $NICE "$probe" --samples 3 | "$python" -c '
import json, sys; r = json.loads(sys.stdin.read()); r["impl"] = "stream_near"; r["model"] = sys.argv[1]
r["round"] = int(sys.argv[2]); print(json.dumps(r))' "$1" "$r" >> "$results"
}

run_torch() {  # model precision
  local shape=("${peer_dense[@]}")
  [ "$1" = extract ] && shape=("${peer_extract[@]}")
  [ "$1" = dense16k ] && shape=("${peer_dense16k[@]}")
  $NICE "$python" "$here/torch_decode.py" "${shape[@]}" --precision "$2" --tokens "$tokens" \
      --rounds 1 | "$python" -c '
import json, sys
r = json.loads(sys.stdin.read()); r["model"] = sys.argv[1]; print(json.dumps(r))' "$1" >> "$results"
}

for r in $(seq 1 "$rounds"); do
  echo "decode_bench: round $r of $rounds" >&2
  $NICE "$probe" --samples 5 | "$python" -c '
import json, sys; r = json.loads(sys.stdin.read()); r["impl"] = "stream"; print(json.dumps(r))' >> "$results"
  $NICE "$kernel" --samples 9 --hugepages 1 | "$python" -c '
import json, sys; r = json.loads(sys.stdin.read()); r["impl"] = "kernel"; print(json.dumps(r))' >> "$results"
  for model in "${models[@]}"; do
    # Alternate the order between rounds so that neither side always runs first.
    if [ $((r % 2)) = 1 ]; then order="sigma torch"; else order="torch sigma"; fi
    for impl in $order; do
      [ "$impl" = torch ] && [ "$peer" = 0 ] && continue
      if [ "$impl" = sigma ]; then precisions="fp32 bf16 int8"; else precisions="fp32 bf16"; fi
      if [ "$impl" = sigma ]; then probe_near "$model"; fi
      for precision in $precisions; do "run_$impl" "$model" "$precision"; done
      if [ "$impl" = sigma ]; then probe_near "$model"; fi
    done
  done
done

"$python" - "$results" "$machine" "$load_before" "$(cut -d' ' -f1-3 /proc/loadavg)" <<'EOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
isas = sorted({r["isa"] for r in rows if r["impl"] == "kernel"})
tag = f"[{sys.argv[2]}; GEMV isa {'/'.join(isas) or '?'}]"
print(f"machine: {sys.argv[2]}; GEMV kernels: {'/'.join(isas) or '?'}; load average before "
      f"{sys.argv[3]}, after {sys.argv[4]}")
streams = [r for r in rows if r["impl"] == "stream"]
reads = ("read_gbs_1t", "read_gbs", "read_prefetched_gbs_1t", "read_prefetched_gbs")
def near_bound(r):  # the mean of the best reads just before and after r's model's Sigma runs
    near = [max(s[k] for k in reads) for s in rows if s["impl"] == "stream_near"
            and s["model"] == r["model"] and s["round"] == r.get("round")]
    return sum(near) / len(near) * 1e9 if near else None
bw = statistics.median(max(s[k] for k in reads) for s in streams) * 1e9
triad = statistics.median(s["triad_gbs"] for s in streams)
print(f"read bandwidth {bw * 1e-9:.2f} GB/s (median of {len(streams)} rounds; the best of 1 and 2 "
      f"threads, plain and prefetched: {[tuple(s[k] for k in reads) for s in streams]}); "
      f"triad {triad:.2f} GB/s {tag}")
kern = [r for r in rows if r["impl"] == "kernel"]
if kern:
    med = {k: statistics.median(r[k] for r in kern) for k in ("gemv_fp32_gbs", "gemv_bf16_gbs", "gemv_int8_gbs", "onednn_fp32_gbs", "read_gbs")}
    print("weight stream alone (bench_gemv, GB/s, median of rounds): " +
          ", ".join(f"{k[:-4]} {v:.2f}" for k, v in med.items()) +
          f"; GEMV fp32 / read {med['gemv_fp32_gbs'] / med['read_gbs']:.0%}, "
          f"bf16 / read {med['gemv_bf16_gbs'] / med['read_gbs']:.0%}, "
          f"int8 / read {med['gemv_int8_gbs'] / med['read_gbs']:.0%}, "
          f"oneDNN M=1 / read {med['onednn_fp32_gbs'] / med['read_gbs']:.0%} {tag}")
print(f"{'model':8} {'impl':8} {'precision':9} {'KV cache':8} {'tokens/s':>9} {'rounds':28} {'MB/token':>9} "
      f"{'bound t/s':>9} {'of bound':>8} {'of near':>8}  machine")
summary = {}
for model in ("dense", "extract", "dense16k"):
    for impl in ("sigma", "pytorch"):
        for prec in ("fp32", "bf16", "int8"):
            rs = [r for r in rows if r.get("model") == model and r["impl"] == impl and r["precision"] == prec]
            if not rs:
                continue
            tps = statistics.median(r["tokens_per_s"] for r in rs)
            b = rs[0]["weight_bytes_per_token"]
            summary[(model, impl, prec)] = tps
            # "of near": each round's tokens/s against the bound read around it, then the median.
            nears = [r["tokens_per_s"] * b / near_bound(r) for r in rs if near_bound(r)]
            of_near = f"{statistics.median(nears):8.1%}" if nears else f"{'-':>8}"
            kv = rs[0].get("kv_cache", prec)  # the peer caches in its weights' type
            print(f"{model:8} {impl:8} {prec:9} {kv:8} {tps:9.1f} {str([round(r['tokens_per_s'], 1) for r in rs]):28} "
                  f"{b * 1e-6:9.1f} {bw / b:9.1f} {tps * b / bw:8.1%} {of_near}  {tag}")
for model in ("dense", "extract", "dense16k"):
    for prec in ("fp32", "bf16"):
        s, t = summary.get((model, "sigma", prec)), summary.get((model, "pytorch", prec))
        if s and t:
            print(f"{model} {prec}: sigma / pytorch = {s / t:.2f}x {tag}")
# int8 against bf16 and fp32, within each round (the two ran back to back), then the median.
for model in ("dense", "extract", "dense16k"):
    def per_round(prec):
        return [r for r in rows if r.get("model") == model and r["impl"] == "sigma" and r["precision"] == prec]
    f32, b16, i8 = per_round("fp32"), per_round("bf16"), per_round("int8")
    if not (f32 and b16 and i8):
        continue
    speed = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(i8, b16)]
    held = {p: statistics.median(r["held_bytes"] for r in rs) for p, rs in (("fp32", f32), ("bf16", b16), ("int8", i8))}
    rss = {p: statistics.median(r["resident_bytes"] for r in rs) for p, rs in (("fp32", f32), ("bf16", b16), ("int8", i8))}
    print(f"{model} int8 / bf16 tokens/s: {statistics.median(speed):.2f}x (rounds {[round(x, 2) for x in speed]}); "
          f"weights held (MB) fp32 {held['fp32'] * 1e-6:.1f}, bf16 {held['bf16'] * 1e-6:.1f} "
          f"({held['bf16'] / held['fp32']:.2f}x), int8 {held['int8'] * 1e-6:.1f} ({held['int8'] / held['fp32']:.2f}x); "
          f"process resident (MB) fp32 {rss['fp32'] * 1e-6:.1f}, bf16 {rss['bf16'] * 1e-6:.1f}, int8 {rss['int8'] * 1e-6:.1f} {tag}")
EOF
