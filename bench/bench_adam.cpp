// The ECSS Adam kernel's speed against the memory bandwidth it is bound by, measured in the same
// run (issue 5). Usage: bench_adam [N=100000000] [REPEATS=15]   (threads: OMP_NUM_THREADS)
//
// Every variant updates the same N parameters in place. The bandwidth probe is a triad-like
// in-place read-modify-write with Adam's access pattern and no arithmetic to speak of
// (w += a*g, m = b*m + g, v = c*v + g: w, m, v read and written, g read; 28 bytes per parameter
// with fp32 g, 26 with bf16 g), split over the threads like the kernel. Variants run round-robin,
// REPEATS rounds (each round starting with the next variant), and each reports its median, so a burst of load from other jobs hits all of
// them alike; the load average is printed before and after.
#include <fmt/core.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "core/passive_wait.h"
#include "kernels/cpu/adam.h"
#include "kernels/ops.h"

// GCC 12 flags its own _mm512_undefined_ps() in these headers (GCC bug 105593).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

using namespace sigma;
using cpu::adam_best_path;
using cpu::adam_path_available;
using cpu::adam_path_name;
using cpu::adam_step;
using cpu::AdamPath;

namespace {

template <class T>
T* alloc(int64_t n) {
  void* p = std::aligned_alloc(64, (size_t(n) * sizeof(T) + 63) / 64 * 64);
  if (!p) {
    fmt::print(stderr, "out of memory for {} elements\n", n);
    std::exit(1);
  }
  return static_cast<T*>(p);
}

std::string loadavg() {
  std::ifstream f("/proc/loadavg");
  std::string a, b, c;
  f >> a >> b >> c;
  return a + " " + b + " " + c;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The in-place bandwidth probe: Adam's loads and stores with three FMAs per element, split
// over the threads exactly as adam_step splits (static chunks of whole 64-byte lines), written
// with the same intrinsics, so the only difference from the kernel is the arithmetic.
template <class Body>
void split(int64_t n, Body body) {
#pragma omp parallel
  {
    const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t chunk = ((n + nt - 1) / nt + 15) / 16 * 16;
    const int64_t b = std::min(n, t * chunk), e = std::min(n, b + chunk);
    if (b < e) body(b, e);
  }
}

__attribute__((target("avx512f"))) inline __m512 load16(const float* g) {
  return _mm512_loadu_ps(g);
}
__attribute__((target("avx512f"))) inline __m512 load16(const uint16_t* g) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline float load1(const float* g) { return *g; }
inline float load1(const uint16_t* g) {
  const uint32_t b = uint32_t(*g) << 16;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

template <class G>
__attribute__((target("avx512f"))) void probe_range(float* w, float* m, float* v, const G* g,
                                                    int64_t b, int64_t e) {
  const __m512 a = _mm512_set1_ps(1e-3f), h = _mm512_set1_ps(0.5f);
  int64_t i = b;
  for (; i + 16 <= e; i += 16) {
    const __m512 gv = load16(g + i);
    _mm512_storeu_ps(w + i, _mm512_fmadd_ps(a, gv, _mm512_loadu_ps(w + i)));
    _mm512_storeu_ps(m + i, _mm512_fmadd_ps(h, _mm512_loadu_ps(m + i), gv));
    _mm512_storeu_ps(v + i, _mm512_fmadd_ps(h, _mm512_loadu_ps(v + i), gv));
  }
  for (; i < e; ++i) {
    const float gi = load1(g + i);
    w[i] += 1e-3f * gi, m[i] = 0.5f * m[i] + gi, v[i] = 0.5f * v[i] + gi;
  }
}

template <class G>
void probe(float* w, float* m, float* v, const G* g, int64_t n) {
  split(n, [&](int64_t b, int64_t e) { probe_range(w, m, v, g, b, e); });
}

// The textbook loop, one thread, compiled as the project compiles (-O3 -march=native
// -fno-math-errno): what one gets without writing a kernel.
void plain_loop(float* w, float* m, float* v, const float* g, int64_t n, float lr, float b1,
                float b2, float eps, float wd, float bc1, float bc2) {
  for (int64_t i = 0; i < n; ++i) {
    m[i] = b1 * m[i] + (1 - b1) * g[i];
    v[i] = b2 * v[i] + (1 - b2) * g[i] * g[i];
    const float mh = m[i] / bc1, vh = v[i] / bc2;
    w[i] -= lr * (mh / (std::sqrt(vh) + eps) + wd * w[i]);
  }
}

// The same loop with the vectoriser off: the scalar code a compiler emits when it cannot
// vectorise (e.g. sqrtf without -fno-math-errno; see LIMITS.md).
__attribute__((optimize("no-tree-vectorize"))) void plain_loop_novec(
    float* w, float* m, float* v, const float* g, int64_t n, float lr, float b1, float b2,
    float eps, float wd, float bc1, float bc2) {
  for (int64_t i = 0; i < n; ++i) {
    m[i] = b1 * m[i] + (1 - b1) * g[i];
    v[i] = b2 * v[i] + (1 - b2) * g[i] * g[i];
    const float mh = m[i] / bc1, vh = v[i] / bc2;
    w[i] -= lr * (mh / (std::sqrt(vh) + eps) + wd * w[i]);
  }
}

}  // namespace

int main(int argc, char** argv) {
  sigma::ensure_passive_omp_wait(argv);  // as sigma runs (core/passive_wait.h)
  const int64_t n = argc > 1 ? std::atoll(argv[1]) : 100'000'000;
  const int repeats = argc > 2 ? std::max(1, std::atoi(argv[2])) : 15;
  const int threads = omp_get_max_threads();
  if (!adam_path_available(AdamPath::Avx512)) {
    fmt::print(stderr, "bench_adam: the bandwidth probe needs AVX-512F, which this CPU lacks\n");
    return 1;
  }
  fmt::print("bench_adam: n = {}, {} thread(s), {} rounds, best path {}, load average {}\n", n,
             threads, repeats, adam_path_name(adam_best_path()), loadavg());

  float *w = alloc<float>(n), *m = alloc<float>(n), *v = alloc<float>(n), *g = alloc<float>(n);
  uint16_t* gb = alloc<uint16_t>(n);
#pragma omp parallel for schedule(static)  // first touch by the threads that will use the pages
  for (int64_t i = 0; i < n; ++i) {
    w[i] = 0.02f * float((i * 7919) % 1001 - 500) / 500.0f;
    m[i] = 0.0f;
    v[i] = 0.0f;
    g[i] = 1e-3f * float((i * 104729) % 2001 - 1000) / 1000.0f;
    uint32_t bits;
    std::memcpy(&bits, &g[i], 4);
    gb[i] = uint16_t(bits >> 16);
  }

  AdamStepArgs a;
  a.lr = 1e-4f;
  a.weight_decay = 0.1f;
  int64_t step = 0;
  auto next = [&] {
    AdamStepArgs s = a;
    s.step = ++step;
    return s;
  };
  struct Variant {
    std::string name;
    double bytes;  // per parameter
    std::function<void()> run;
    std::vector<double> secs;
  };
  const AdamPath best = adam_best_path();
  std::vector<Variant> vs = {
      {"probe: in-place RMW, fp32 g", 28, [&] { probe(w, m, v, g, n); }, {}},
      {"probe: in-place RMW, bf16 g", 26, [&] { probe(w, m, v, gb, n); }, {}},
      {fmt::format("adam_step {} fp32 g", adam_path_name(best)), 28,
       [&] { adam_step(w, m, v, g, n, next(), best); }, {}},
      {fmt::format("adam_step {} bf16 g", adam_path_name(best)), 26,
       [&] { adam_step(w, m, v, gb, n, next(), best); }, {}},
      {"adam_step scalar path, fp32 g", 28,
       [&] { adam_step(w, m, v, g, n, next(), AdamPath::Scalar); }, {}},
      {"ops::adam_step (front, cpu backend)", 28,
       [&] { ops::adam_step(w, m, v, g, n, next()); }, {}},
      {"plain loop, 1 thread", 28,
       [&] {
         const AdamStepArgs s = next();
         const AdamBiasCorrections bc = adam_bias_corrections(s.beta1, s.beta2, s.step);
         plain_loop(w, m, v, g, n, s.lr, s.beta1, s.beta2, s.eps, s.weight_decay, bc.bc1, bc.bc2);
       },
       {}},
      {"plain loop, not vectorised, 1 thread", 28,
       [&] {
         const AdamStepArgs s = next();
         const AdamBiasCorrections bc = adam_bias_corrections(s.beta1, s.beta2, s.step);
         plain_loop_novec(w, m, v, g, n, s.lr, s.beta1, s.beta2, s.eps, s.weight_decay, bc.bc1,
                          bc.bc2);
       },
       {}},
  };
  for (auto& x : vs) x.run();  // warm-up: page faults, frequency
  for (int r = 0; r < repeats; ++r)
    for (size_t k = 0; k < vs.size(); ++k) {  // a different variant first in every round
      auto& x = vs[(k + size_t(r)) % vs.size()];
      const auto t0 = std::chrono::steady_clock::now();
      x.run();
      x.secs.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }

  const double probe32 = median(vs[0].secs), probe16 = median(vs[1].secs);
  fmt::print("{:<38} {:>9} {:>10} {:>8} {:>13}\n", "variant", "ms", "Gparam/s", "GB/s",
             "of probe BW");
  for (auto& x : vs) {
    const double s = median(x.secs);
    const double probe = x.bytes == 26 ? probe16 : probe32;
    fmt::print("{:<38} {:>9.2f} {:>10.3f} {:>8.1f} {:>12.1f}%\n", x.name, s * 1e3, n / s * 1e-9,
               n * x.bytes / s * 1e-9, 100.0 * probe / s);
  }
  fmt::print("load average after: {}\n", loadavg());
  std::free(w), std::free(m), std::free(v), std::free(g), std::free(gb);
  return 0;
}
