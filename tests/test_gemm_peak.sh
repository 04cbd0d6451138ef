#!/usr/bin/env bash
# ctest Bench.GemmPeakRunsOnEveryCpuKind: bench/run_train_bench.sh divides by gemm_peak's limits,
# so gemm_peak must run on every machine kind, AVX2-only ones included, where oneDNN has no bf16
# matmul (it aborted there until issue 40's Zen 3 draw). One sample of each shape: a smoke run,
# the figures are not checked beyond being positive.
# Usage: test_gemm_peak.sh GEMM_PEAK
set -euo pipefail
out=$("$1" --threads 2 --samples 1 --min-ms 1)
python3 - "$out" <<'PY'
import json, sys
j = json.loads(sys.argv[1])
assert j["gemm_peak_gflops"] > 0, j
assert isinstance(j["bf16_native"], bool), "no bf16_native in gemm_peak's output"
assert j["bf16_peak_gflops"] > 0 and j["sigma_bf16_shapes"], j
if not j["bf16_native"]:  # the widened bf16 products run on sgemm: that is their limit
    assert j["bf16_peak_gflops"] == j["gemm_peak_gflops"] and not j["bf16_shapes"], j
print(f"gemm_peak: sgemm {j['gemm_peak_gflops']:.1f} GFLOP/s, bf16 native {j['bf16_native']}, "
      f"bf16 limit {j['bf16_peak_gflops']:.1f}")
PY
