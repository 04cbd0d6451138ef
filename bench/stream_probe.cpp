// stream_probe: this machine's memory bandwidth, the denominator of the batch-1 decode benchmark
// (bench/decode_bench.sh, docs/benchmarks.md). Batch-1 decoding reads every weight once per
// token, so its bound is (bytes of weights per token) / (read bandwidth).
//   read:  sum += a[i]            (what a GEMV against weights does: read only), plain and with
//          software prefetch (as the GEMV kernel streams)
//   triad: a[i] = b[i] + s * c[i] (STREAM's triad: 2 reads + 1 write, counted as 3 x 4 bytes)
// Arrays of --mb MiB each (far larger than the caches; on huge pages where granted),
// first-touched by the threads that use them; each figure is the median of --samples passes,
// for 1 thread and for --threads threads.
// Prints one JSON line: {"read_gbs_1t":..,"read_gbs":..,"read_prefetched_gbs_1t":..,
// "read_prefetched_gbs":..,"triad_gbs_1t":..,"triad_gbs":..}.
//
//   stream_probe [--threads 2] [--samples 9] [--mb 256]
#include <immintrin.h>
#include <omp.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "core/passive_wait.h"
#include "simd.h"

namespace {

using namespace sigma::bench;

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// One pass of `kernel` over n floats on `threads` threads; returns GB/s for `bytes_per_float`.
template <class Kernel>
double bandwidth(int threads, int samples, int64_t n, double bytes_per_float, Kernel kernel) {
  std::vector<double> gbs;
  for (int s = 0; s < samples + 1; ++s) {  // the first pass warms up (page tables, clocks)
    const double t0 = now();
#pragma omp parallel num_threads(threads)
    {
      const int64_t per = (n / omp_get_num_threads() + 15) / 16 * 16;
      const int64_t i0 = std::min(n, per * omp_get_thread_num()), i1 = std::min(n, i0 + per);
      kernel(i0, i1);
    }
    const double dt = now() - t0;
    if (s > 0) gbs.push_back(double(n) * bytes_per_float / dt * 1e-9);
  }
  return median(gbs);
}

struct Arrays {
  float *a, *b, *c;
  int64_t n;
};

volatile float g_sink;  // keeps the read kernel's sums alive

double read_gbs(const Arrays& x, int threads, int samples) {
  return bandwidth(threads, samples, x.n, 4.0, [&](int64_t i0, int64_t i1) {
    vfloat s[4] = {};
    for (int64_t i = i0; i < i1; i += 64) {
      add64(s, x.a + i);
    }
    g_sink = sum(s[0] + s[1] + s[2] + s[3]);
  });
}

// The same read with software prefetch into L2 (`ahead` floats ahead), as the GEMV kernel
// streams its weights: a core keeps more lines in flight than its hardware prefetcher asks for,
// so this read is faster than the plain one on this machine, and the bound is the better of
// the two.
double read_prefetched_gbs(const Arrays& x, int threads, int samples, int64_t ahead) {
  return bandwidth(threads, samples, x.n, 4.0, [&](int64_t i0, int64_t i1) {
    vfloat s[4] = {};
    for (int64_t i = i0; i < i1; i += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(x.a + i + ahead), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(x.a + i + ahead + 16), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(x.a + i + ahead + 32), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(x.a + i + ahead + 48), _MM_HINT_T1);
      add64(s, x.a + i);
    }
    g_sink = sum(s[0] + s[1] + s[2] + s[3]);
  });
}

double triad_gbs(const Arrays& x, int threads, int samples) {
  return bandwidth(threads, samples, x.n, 12.0, [&](int64_t i0, int64_t i1) {
    const vfloat s = splat(3.0f);
    for (int64_t i = i0; i < i1; i += kLanes)
      store(x.a + i, s * load(x.c + i) + load(x.b + i));
  });
}

}  // namespace

int main(int argc, char** argv) {
  sigma::ensure_passive_omp_wait(argv);  // as sigma runs (core/passive_wait.h)
  int threads = 2, samples = 9;
  int64_t mb = 256;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    if (k == "--threads") threads = std::atoi(argv[i + 1]);
    else if (k == "--samples") samples = std::atoi(argv[i + 1]);
    else if (k == "--mb") mb = std::atol(argv[i + 1]);
    else {
      std::fprintf(stderr, "usage: stream_probe [--threads 2] [--samples 9] [--mb 256]\n");
      return 2;
    }
  }
  if (threads < 1 || samples < 1 || mb < 1) {
    std::fprintf(stderr, "stream_probe: --threads, --samples and --mb must be positive\n");
    return 2;
  }
  Arrays x{nullptr, nullptr, nullptr, (mb << 20) / 4 / 64 * 64};
  // On transparent huge pages where the system grants them (madvise before the first touch), as
  // the model holds its streamed weights (Model::use_weights): the bound is the best read.
  const size_t huge = size_t(2) << 20, bytes = (size_t(x.n) * 4 + huge - 1) / huge * huge;
  for (float** p : {&x.a, &x.b, &x.c}) {
    *p = static_cast<float*>(std::aligned_alloc(huge, bytes));
    if (!*p) return 1;
    ::madvise(*p, bytes, MADV_HUGEPAGE);  // a hint
  }
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t i = 0; i < x.n; ++i) x.a[i] = 1.0f, x.b[i] = 2.0f, x.c[i] = 0.5f;
  const double r1 = read_gbs(x, 1, samples), rn = read_gbs(x, threads, samples);
  double p1 = 0, pn = 0;  // the best prefetch distance of a few
  for (int64_t ahead : {int64_t(1024), int64_t(4096), int64_t(16384)}) {
    p1 = std::max(p1, read_prefetched_gbs(x, 1, samples, ahead));
    pn = std::max(pn, read_prefetched_gbs(x, threads, samples, ahead));
  }
  const double t1 = triad_gbs(x, 1, samples), tn = triad_gbs(x, threads, samples);
  std::printf("{\"threads\":%d,\"mb\":%ld,\"read_gbs_1t\":%.2f,\"read_gbs\":%.2f,"
              "\"read_prefetched_gbs_1t\":%.2f,\"read_prefetched_gbs\":%.2f,"
              "\"triad_gbs_1t\":%.2f,\"triad_gbs\":%.2f}\n",
              threads, long(mb), r1, rn, p1, pn, t1, tn);
  for (float* p : {x.a, x.b, x.c}) std::free(p);
  return 0;
}
