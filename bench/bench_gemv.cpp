// bench_gemv: the batch-1 decode's weight stream alone (bench/decode_bench.sh runs it): per
// "token", the matrix-vector products of a d-wide, L-block decoder (QKV [d,3d], output [d,d],
// FFN [d,4d] and [4d,d] per block) through the cpu backend's GEMV kernels (kernels/cpu/gemv.h),
// on fp32 weights, on bf16 copies and on int8 weights with a scale per column, each in the
// column panels inference lays them out in (Model::use_weights), the fp32 weights also in rows
// (the training model's layout, gemv_fp32_rows), against oneDNN's sgemm at M = 1 (what the
// backend ran before), alternating with a read of the same number of bytes (the bandwidth
// bound, measured the same way as bench/stream_probe.cpp). Medians of --samples tokens of each.
// Prints one JSON line: {"isa":..,"gemv_fp32_gbs":..,"gemv_bf16_gbs":..,"gemv_int8_gbs":..,
// "onednn_fp32_gbs":..,"read_gbs":..,"gemv_fp32_rows_gbs":..} where X_gbs = bytes of weights
// (and int8 scales) per token / time per token.
//
//   bench_gemv [--d 512] [--layers 8] [--samples 15] [--isa best|avx512vnni|avx512|avx2|portable]
//              [--vocab V]  (V > 0: also the tied head's [V, d] product, gemv_nt, per token)
//              [--clock wall|cpu]  (cpu: the thread's CPU time; with OMP_NUM_THREADS=1 only)
//              [--hugepages 0|1]  (1: the weights in 2 MiB-aligned memory with madvise(MADV_HUGEPAGE),
//                                  transparent huge pages where the system allows them)
//              [--stat median|best]  (best: the fastest sample of each, for A/B runs on a shared
//                                     machine, where the fastest is the least disturbed)
#include <immintrin.h>
#include <omp.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <ctime>
#include <vector>

#include "core/bf16.h"
#include "core/passive_wait.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/gemv.h"
#include "simd.h"

namespace {

using namespace sigma::bench;

// --clock cpu: the calling thread's CPU time, not the wall clock: on a shared machine a
// single-threaded run (OMP_NUM_THREADS=1) then leaves out the time it was preempted.
bool g_cpu_clock = false;
double now() {
  if (g_cpu_clock) {
    timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return double(t.tv_sec) + 1e-9 * double(t.tv_nsec);
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct Shape {
  int64_t in, out;
  bool head = false;  // the tied head: w[out, in], one dot product per output (gemv_nt)
};

volatile float g_sink;

// n elements of T, 2 MiB-aligned, optionally marked for transparent huge pages (never freed: the
// process ends with the benchmark).
template <class T>
T* weights_alloc(size_t n, bool huge) {
  constexpr size_t kHuge = size_t(2) << 20;
  const size_t bytes = (n * sizeof(T) + kHuge - 1) / kHuge * kHuge;
  T* p = static_cast<T*>(std::aligned_alloc(kHuge, bytes));
  if (!p) std::abort();
  if (huge) ::madvise(p, bytes, MADV_HUGEPAGE);  // a hint
  return p;
}

// Sum of n floats over the threads (the read bandwidth).
void read_all(const float* a, int64_t n) {
#pragma omp parallel
  {
    const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t per = (n / nt + 63) / 64 * 64, i0 = std::min(n, t * per), i1 = std::min(n, i0 + per);
    vfloat s[4] = {};
    int64_t i = i0;
    for (; i + 64 <= i1; i += 64) add64(s, a + i);
    float total = sum(s[0] + s[1] + s[2] + s[3]);
    for (; i < i1; ++i) total += a[i];
    g_sink = total;
  }
}

bool g_best = false;  // --stat best
double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return g_best ? v.back() : v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  sigma::ensure_passive_omp_wait(argv);  // as sigma runs (core/passive_wait.h)
  int64_t d = 512, layers = 8, vocab = 0;
  int samples = 15;
  sigma::cpu::GemvIsa isa = sigma::cpu::GemvIsa::Best;
  bool huge = false;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    if (k == "--isa") {
      const std::string v = argv[i + 1];
      using sigma::cpu::GemvIsa;
      for (GemvIsa i : {GemvIsa::Avx512Vnni, GemvIsa::Avx512, GemvIsa::Avx2, GemvIsa::Portable})
        if (v == sigma::cpu::gemv_isa_name(i)) isa = i;
      if (!sigma::cpu::gemv_isa_available(isa)) {
        std::fprintf(stderr, "bench_gemv: this CPU cannot run --isa %s\n", v.c_str());
        return 2;
      }
      continue;
    }
    if (k == "--stat") {
      g_best = std::string(argv[i + 1]) == "best";
      continue;
    }
    if (k == "--clock") {
      g_cpu_clock = std::string(argv[i + 1]) == "cpu";
      continue;
    }
    if (k == "--hugepages") huge = std::atoi(argv[i + 1]) != 0;
    else if (k == "--d") d = std::atol(argv[i + 1]);
    else if (k == "--layers") layers = std::atol(argv[i + 1]);
    else if (k == "--samples") samples = std::atoi(argv[i + 1]);
    else if (k == "--vocab") vocab = std::atol(argv[i + 1]);
    else {
      std::fprintf(stderr, "usage: bench_gemv [--d 512] [--layers 8] [--samples 15] "
                           "[--isa best|avx512vnni|avx512|avx2|portable] [--vocab 0] [--clock wall|cpu] [--hugepages 0|1] "
                           "[--stat median|best]\n");
      return 2;
    }
  }
  if (g_cpu_clock && omp_get_max_threads() > 1) {
    std::fprintf(stderr, "bench_gemv: --clock cpu measures one thread: run it with OMP_NUM_THREADS=1\n");
    return 2;
  }
  sigma::cpu::gemv_use_isa(isa);
  std::vector<Shape> shapes;
  for (int64_t l = 0; l < layers; ++l)
    for (Shape s : {Shape{d, 3 * d}, Shape{d, d}, Shape{d, 4 * d}, Shape{4 * d, d}}) shapes.push_back(s);
  if (vocab > 0) shapes.push_back({d, vocab, true});
  int64_t total = 0;
  for (Shape s : shapes) total += s.in * s.out;
  const size_t n = size_t(total), nx = size_t(std::max(4 * d, vocab));
  std::vector<float> x(nx, 0.01f), y(nx);
  float* w = weights_alloc<float>(n, huge);
  uint16_t* w16 = weights_alloc<uint16_t>(n, huge);
  int8_t* w8 = weights_alloc<int8_t>(n, huge);
  int64_t columns = 0;  // int8: a scale per column of each matrix
  for (Shape s : shapes) columns += s.out;
  std::vector<float> scale(size_t(columns), 1e-3f);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < total; ++i) {
    w[i] = float(i % 97) * 1e-3f;
    w16[i] = sigma::to_bf16(w[i]);
    w8[i] = int8_t(i % 97 - 48);
  }
  // 0: gemv fp32 (panels), 1: gemv bf16, 2: oneDNN fp32, 3: read, 4: int8, 5: gemv fp32 in rows
  auto token = [&](int kind) {
    if (kind == 3) return read_all(w, total);
    int64_t off = 0, col = 0;
    for (Shape s : shapes) {
      if (s.head) {  // y[out] = w[out, in] x
        if (kind == 0 || kind == 5) sigma::cpu::gemv_nt(y.data(), x.data(), w + off, 1, s.in, s.out, s.in, s.in, s.out);
        if (kind == 1) sigma::cpu::gemv_nt(y.data(), x.data(), w16 + off, 1, s.in, s.out, s.in, s.in, s.out);
        if (kind == 2)
          sigma::cpu::gemm(false, true, 1, s.out, s.in, 1.0f, x.data(), s.in, w + off, s.in,
                           0.0f, y.data(), s.out);
        if (kind == 4)
          sigma::cpu::gemv_nt(y.data(), x.data(), w8 + off, scale.data() + col, 1, s.in,
                              s.out, s.in, s.in, s.out);
        off += s.in * s.out;
        col += s.out;
        continue;
      }
      // (fp32 and bf16 read as panels, kernels::panel_index: the values' order times nothing)
      if (kind == 0)
        sigma::cpu::gemv_nn_panels(y.data(), x.data(), w + off, nullptr, 1, s.in, s.out, false, {});
      if (kind == 5)
        sigma::cpu::gemv_nn(y.data(), x.data(), w + off, nullptr, 1, s.in, s.out, false, {});
      if (kind == 1)
        sigma::cpu::gemv_nn(y.data(), x.data(), w16 + off, nullptr, 1, s.in, s.out, false, {});
      if (kind == 2)
        sigma::cpu::gemm(false, false, 1, s.out, s.in, 1.0f, x.data(), s.in, w + off, s.out,
                         0.0f, y.data(), s.out);
      if (kind == 4)
        sigma::cpu::gemv_nn(y.data(), x.data(), w8 + off, scale.data() + col, nullptr, 1,
                            s.in, s.out, false, {});
      off += s.in * s.out;
      col += s.out;
    }
  };
  std::vector<std::vector<double>> gbs(6);
  for (int s = 0; s < samples + 1; ++s)
    for (int kind = 0; kind < 6; ++kind) {  // alternating, the first sample warms up
      const double t0 = now();
      token(kind);
      const double dt = now() - t0;
      const double bytes = kind == 4 ? double(total) + 4.0 * double(columns)
                                     : double(total) * (kind == 1 ? 2 : 4);
      if (s > 0) gbs[size_t(kind)].push_back(bytes / dt * 1e-9);
    }
  std::printf("{\"isa\":\"%s\",\"stat\":\"%s\",\"clock\":\"%s\",\"hugepages\":%d,\"d\":%ld,\"layers\":%ld,\"threads\":%d,\"weights\":%ld,\"gemv_fp32_gbs\":%.2f,"
              "\"gemv_bf16_gbs\":%.2f,\"gemv_int8_gbs\":%.2f,\"onednn_fp32_gbs\":%.2f,"
              "\"read_gbs\":%.2f,\"gemv_fp32_rows_gbs\":%.2f}\n",
              sigma::cpu::gemv_isa_name(sigma::cpu::gemv_isa()), g_best ? "best" : "median", g_cpu_clock ? "cpu" : "wall", int(huge), long(d), long(layers), omp_get_max_threads(), long(total), median(gbs[0]),
              median(gbs[1]), median(gbs[4]), median(gbs[2]), median(gbs[3]), median(gbs[5]));
  return 0;
}
