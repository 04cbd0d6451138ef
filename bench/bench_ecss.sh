#!/usr/bin/env bash
# ECSS benchmarks of issue 5 (docs/benchmarks.md, "ECSS in training"), with build/bench_ecss:
#   scaling  experts per group 4 -> 64 at fixed active parameters, ECSS against vanilla
#            offload, store in RAM (8 domains, one domain's batch per step)
#   big      a file-backed store of more than 32 GB (experts + Adam state) on this 24 GiB
#            machine, 50 ECSS steps; prints per-step time and resident memory to big.log
# Runs at high priority (nice -19 in its own autogroup, as run_train_bench.sh --nice -19), so
# that other load on the shared cores disturbs the figures less.
# Usage: bench/bench_ecss.sh [--build DIR] [--out DIR] [--store PATH] [scaling] [big]
set -euo pipefail
BUILD=build OUT=runs/bench-ecss STORE=/var/tmp/sigma-ecss-big.bin PARTS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --build) BUILD=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --store) STORE=$2; shift 2 ;;
    scaling|big) PARTS+=("$1"); shift ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
[ ${#PARTS[@]} -gt 0 ] || PARTS=(scaling big)
mkdir -p "$OUT"
pri() { setsid -w bash -c 'echo -19 > /proc/self/autogroup 2>/dev/null || true; exec nice -n -19 "$@"' bash "$@"; }
export OMP_WAIT_POLICY=passive
for part in "${PARTS[@]}"; do
  case $part in
    scaling)
      pri "$BUILD/bench_ecss" --d 128 --layers 4 --rre 2 --T 256 --batch 16 --vocab 4096 \
        --groups 8 --experts 4,8,16,32,64 --modes ecss,vanilla --steps 8 --warmup 2 \
        | tee "$OUT/scaling.txt" ;;
    big)
      free -g | tee "$OUT/big.txt"
      pri "$BUILD/bench_ecss" --d 512 --layers 4 --rre 2 --T 128 --batch 8 --vocab 4096 \
        --groups 32 --experts 22 --modes ecss --steps 50 --warmup 1 --store "$STORE" \
        2> "$OUT/big.log" | tee -a "$OUT/big.txt" ;;
  esac
done
