// fma_peak: this machine's arithmetic peak on THREADS cores, the second MFU denominator of the
// training benchmark (docs/benchmarks.md): what no GEMM can beat.
//   fp32: FMAs of the widest registers (512-bit vfmadd231ps, 32 FLOPs each, or 256-bit ones
//         on an AVX2 machine) on 16 (AVX2: 12) independent accumulators per thread, enough to
//         cover the FMA latency on two pipes;
//   bf16: 512-bit bf16 dot products (vdpbf16ps: 16 lanes x 2 products x 2 = 64 FLOPs) alike,
//         where the CPU has avx512_bf16.
// Each: `--samples` timed samples of `--iters` loop trips per thread; the figure is the median.
// Prints one JSON line: {"fma_peak_gflops":..,"bf16_dot_peak_gflops":..,...}.
//
//   fma_peak [--threads 2] [--samples 7] [--iters 20000000]
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "simd.h"

namespace {

using namespace sigma::bench;

// Registers: 32 with AVX-512, 16 with AVX2 (two for the constants).
constexpr int kAcc = kLanes == 16 ? 16 : 12;

// One thread's loop; returns a value derived from the accumulators so none is optimised away.
float fp32_loop(long iters) {
  vfloat acc[kAcc];
  for (int i = 0; i < kAcc; ++i) acc[i] = splat(float(i) * 1e-3f);
  const vfloat a = splat(0.999999f), b = splat(1e-7f);
  for (long t = 0; t < iters; ++t)
    for (int i = 0; i < kAcc; ++i) acc[i] = acc[i] * a + b;  // contracted to FMAs
  vfloat s = acc[0];
  for (int i = 1; i < kAcc; ++i) s += acc[i];
  return sum(s);
}

#ifdef __AVX512BF16__
float bf16_loop(long iters) {
  __m512 acc[kAcc];
  for (int i = 0; i < kAcc; ++i) acc[i] = _mm512_set1_ps(float(i) * 1e-3f);
  const __m512bh a = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-3f), _mm512_set1_ps(2e-3f));
  const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-4f), _mm512_set1_ps(3e-4f));
  for (long t = 0; t < iters; ++t)
    for (int i = 0; i < kAcc; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
  __m512 s = acc[0];
  for (int i = 1; i < kAcc; ++i) s = _mm512_add_ps(s, acc[i]);
  return _mm512_reduce_add_ps(s);
}
#endif

// Median GFLOP/s of `samples` runs of loop(iters) on every thread at once.
template <class Loop>
double measure(Loop loop, double flops_per_trip, long iters, int samples, int threads) {
  std::vector<double> g;
  volatile float sink = 0;
  for (int s = 0; s <= samples; ++s) {  // sample 0 warms the cores up, untimed
    const auto t0 = std::chrono::steady_clock::now();
    float part = 0;
#pragma omp parallel num_threads(threads) reduction(+ : part)
    part += loop(iters);
    const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    sink = sink + part;
    if (s > 0) g.push_back(flops_per_trip * double(iters) * threads / sec / 1e9);
  }
  std::sort(g.begin(), g.end());
  return g[g.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  int threads = 2, samples = 7;
  long iters = 20000000;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--threads" && i + 1 < argc) threads = std::atoi(argv[++i]);
    else if (a == "--samples" && i + 1 < argc) samples = std::atoi(argv[++i]);
    else if (a == "--iters" && i + 1 < argc) iters = std::atol(argv[++i]);
    else {
      std::fprintf(stderr, "usage: fma_peak [--threads N] [--samples N] [--iters N]\n");
      return 2;
    }
  }
  const double fp32 = measure(fp32_loop, 2.0 * kLanes * kAcc, iters, samples, threads);
  double bf16 = 0;
#ifdef __AVX512BF16__
  bf16 = measure(bf16_loop, 64.0 * kAcc, iters, samples, threads);
#endif
  std::printf("{\"impl\":\"fma_peak\",\"threads\":%d,\"fma_peak_gflops\":%.1f,"
              "\"bf16_dot_peak_gflops\":%.1f,\"bf16_dot\":%s}\n",
              threads, fp32, bf16, bf16 > 0 ? "true" : "false");
  return 0;
}
