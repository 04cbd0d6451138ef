#!/usr/bin/env bash
# Where a batch-1 decode token's time goes (issue 40): `sigma generate` under `perf record`
# (call stacks by DWARF), the samples of the decode steps (the calling thread inside
# BatchDecoder::step and the spin team's helpers) sorted by the function they were in:
# products (the GEMV kernels; the x rounding and partial sums around them), attention,
# LayerNorm/activation, hand-offs (helpers spinning, yielding or waking; the caller waiting for
# the helpers' items; both include the prefetch of the next product's item that a waiting
# thread issues, kernels/cpu/spin_team.h's NextJob) and the rest: fractions of all decode threads' CPU time, then of the
# calling thread's alone (a token's wall time), printed with the machine kind.
#
#   [RUNS=4] bench/decode_breakdown.sh [SIGMA=build/sigma] [CKPT] [PRECISION=int8] [TOKENS=250] [KV=auto]
# CKPT defaults to decode_bench.sh's dense model ($DECODE_BENCH_DIR/dense/checkpoints; run
# decode_bench.sh once to make it). Needs `perf` (linux-perf).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
sigma=${1:-build/sigma}
ckpt=${2:-${DECODE_BENCH_DIR:-/tmp/sigma-decode-bench}/dense/checkpoints}
precision=${3:-int8}
tokens=${4:-250}
kv=${5:-auto}  # --kv-cache (auto: as `sigma generate` with the defaults)
command -v perf >/dev/null || { echo "decode_breakdown: needs perf (apt-get install linux-perf)" >&2; exit 2; }
[ -d "$ckpt" ] || { echo "decode_breakdown: no checkpoint $ckpt (run bench/decode_bench.sh first)" >&2; exit 2; }
tmp=$(mktemp -d /tmp/sigma-breakdown.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
export OMP_WAIT_POLICY=passive
# 1,000 samples a second over RUNS runs: at 4,000 the DWARF stack copies slowed an fp32 decode
# by a third (171 against 241-255 tok/s) and doubled the waits they caused (hand-offs 12.9 %
# against 6.2 % at 1,000, which a per-job clock trace confirmed: 4-6 %).
runs=${RUNS:-4}
perf record -q -F 1000 --call-graph dwarf,16384 -o "$tmp/perf.data" -- bash -c '
  for i in $(seq "$1"); do
    "$2" generate --ckpt "$3" --prompt "1 2 3" --max-new "$4" --precision "$5" --kv-cache "$6" > /dev/null
  done' _ "$runs" "$sigma" "$ckpt" "$tokens" "$precision" "$kv" 2> "$tmp/stderr"
perf script -i "$tmp/perf.data" 2>/dev/null | python3 -c '
import collections, re, sys
# (nt_i8_group, the int8 head kernel, inlines into its item: for_each_item<for_each_run<...nt_i8...>>)
rules = [("products: GEMV kernels", r"nn_kernel|nt_kernel|nt_i8_group|nt_group|panel_|for_each_run<.*nt_i8"),
         ("products: x rounding, partial sums", r"nn_i8|::nn<|::nt<|nt_i8|sum_rows|rows16|quantize_rows16|round_row16"),
         ("attention", r"attention|row_scores|row_output"),
         ("layernorm / activation", r"layernorm|gelu|activation"),
         ("hand-offs (spin, yield, wake, wait, prefetch while waiting)", r"for_each_item|_M_run|sched_yield|futex|pvm_irq|schedule|spin_until|syscall")]
cats, caller, stack = collections.Counter(), collections.Counter(), []
def flush():
    joined = " ".join(stack)
    if stack and re.search(r"BatchDecoder::step|Team::Team", joined):
        name = next((n for n, p in rules if re.search(p, stack[0])), "other")
        cats[name] += 1
        if "BatchDecoder::step" in joined:  # the calling thread: its samples are its wall time
            caller[name] += 1
for line in sys.stdin:
    if not line.strip():
        flush(); stack = []
    elif line[0] in " \t":
        m = re.match(r"\s+[0-9a-f]+\s+(.*?)\s+\(", line)
        if m: stack.append(m.group(1))
    else:
        flush(); stack = []
flush()
for title, c in (("decode threads", cats), ("the calling thread alone (its wall time)", caller)):
    total = sum(c.values())
    print(f"{title}: {total} samples ({sys.argv[1]}; {sys.argv[2]})")
    for name, n in c.most_common(): print(f"  {100 * n / max(total, 1):5.1f} %  {name}")
' "$("$here/machine.sh")" "$precision, $kv KV cache, load $(cut -d' ' -f1-3 /proc/loadavg)"
grep -o '([0-9.]* tokens/s[^)]*)' "$tmp/stderr" || true
