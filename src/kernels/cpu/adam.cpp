#include "kernels/cpu/adam.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/error.h"

#if defined(__x86_64__) && defined(__GNUC__)
// GCC 12 reports its own _mm512_undefined_ps() in the intrinsic headers as maybe-uninitialized
// (GCC bug 105593); the values are never read.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#define SIGMA_ADAM_X86 1
#else
#define SIGMA_ADAM_X86 0
#endif

namespace sigma::cpu {

namespace {

// Per-call constants, derived once in fp32 (the ref backend derives the same ones).
struct Consts {
  float b1, b2, omb1, omb2, eps, step_size, inv_sqrt_bc2, decay, gs;
};

Consts consts_of(const AdamStepArgs& a) {
  SIGMA_CHECK(a.step >= 1, "adam_step: step count {} must be >= 1 (it counts this update)", a.step);
  const AdamBiasCorrections bc = adam_bias_corrections(a.beta1, a.beta2, a.step);
  return {a.beta1,         a.beta2, 1.0f - a.beta1, 1.0f - a.beta2, a.eps, a.lr / bc.bc1,
          1.0f / std::sqrt(bc.bc2), a.lr * a.weight_decay, a.grad_scale};
}

inline float grad_f32(const float* g, int64_t i) { return g[i]; }
inline float grad_f32(const uint16_t* g, int64_t i) {
  const uint32_t bits = uint32_t(g[i]) << 16;  // bf16 -> fp32 is exact: the upper half
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// The reference sequence of fp32 operations; the SIMD path performs exactly these, lane-wise.
inline void adam_elem(float& w, float& m, float& v, float g_raw, const Consts& c) {
  const float g = g_raw * c.gs;
  const float mn = std::fma(c.b1, m, c.omb1 * g);
  const float vn = std::fma(c.b2, v, (c.omb2 * g) * g);
  const float den = std::fma(std::sqrt(vn), c.inv_sqrt_bc2, c.eps);
  const float upd = (c.step_size * mn) / den;
  w = w - std::fma(c.decay, w, upd);
  m = mn;
  v = vn;
}

template <class G>
void scalar_range(float* w, float* m, float* v, const G* g, int64_t b, int64_t e, const Consts& c) {
  for (int64_t i = b; i < e; ++i) adam_elem(w[i], m[i], v[i], grad_f32(g, i), c);
}

#if SIGMA_ADAM_X86
// The tests' second build of this file (tests/avx512_emulation.h) runs the AVX-512 path on
// SIMDe's emulation: no target attribute there, and every CPU "has" AVX-512.
#if defined(SIGMA_EMULATED_AVX512)
#define SIGMA_AVX512
#else
#define SIGMA_AVX512 __attribute__((target("avx512f")))
#endif

SIGMA_AVX512 inline __m512 load_g(const float* g) { return _mm512_loadu_ps(g); }
SIGMA_AVX512 inline __m512 load_g(const uint16_t* g) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

template <class G>
SIGMA_AVX512 void avx512_range(float* w, float* m, float* v, const G* g, int64_t b, int64_t e,
                               const Consts& c) {
  const __m512 b1 = _mm512_set1_ps(c.b1), b2 = _mm512_set1_ps(c.b2);
  const __m512 omb1 = _mm512_set1_ps(c.omb1), omb2 = _mm512_set1_ps(c.omb2);
  const __m512 eps = _mm512_set1_ps(c.eps), ss = _mm512_set1_ps(c.step_size);
  const __m512 isb2 = _mm512_set1_ps(c.inv_sqrt_bc2), dec = _mm512_set1_ps(c.decay);
  const __m512 gs = _mm512_set1_ps(c.gs);
  int64_t i = b;
  for (; i + 16 <= e; i += 16) {
    const __m512 gv = _mm512_mul_ps(load_g(g + i), gs);
    __m512 mv = _mm512_loadu_ps(m + i), vv = _mm512_loadu_ps(v + i), wv = _mm512_loadu_ps(w + i);
    mv = _mm512_fmadd_ps(b1, mv, _mm512_mul_ps(omb1, gv));
    vv = _mm512_fmadd_ps(b2, vv, _mm512_mul_ps(_mm512_mul_ps(omb2, gv), gv));
    const __m512 den = _mm512_fmadd_ps(_mm512_sqrt_ps(vv), isb2, eps);
    const __m512 upd = _mm512_div_ps(_mm512_mul_ps(ss, mv), den);
    wv = _mm512_sub_ps(wv, _mm512_fmadd_ps(dec, wv, upd));
    _mm512_storeu_ps(m + i, mv);
    _mm512_storeu_ps(v + i, vv);
    _mm512_storeu_ps(w + i, wv);
  }
  for (; i < e; ++i) adam_elem(w[i], m[i], v[i], grad_f32(g, i), c);  // scalar tail
}

bool cpu_has_avx512() {
#if defined(SIGMA_EMULATED_AVX512)
  return true;
#endif
  static const bool has = __builtin_cpu_supports("avx512f");
  return has;
}
#else
bool cpu_has_avx512() { return false; }
#endif

bool resolve_avx512(AdamPath p) {
  if (p == AdamPath::Auto) return cpu_has_avx512();
  if (p == AdamPath::Avx512) {
    SIGMA_CHECK(cpu_has_avx512(), "adam_step: the AVX-512 path was requested but this CPU "
                                  "lacks AVX-512F; use AdamPath::Auto");
    return true;
  }
  return false;
}

template <class G>
void run(float* w, float* m, float* v, const G* g, int64_t n, const AdamStepArgs& a,
         AdamPath path) {
  const Consts c = consts_of(a);
  const bool avx = resolve_avx512(path);
  auto range = [&](int64_t b, int64_t e) {
#if SIGMA_ADAM_X86
    if (avx) return avx512_range(w, m, v, g, b, e, c);
#endif
    scalar_range(w, m, v, g, b, e, c);
  };
  if (n < kAdamParallelMin || omp_in_parallel() || omp_get_max_threads() == 1) {
    if (n > 0) range(0, n);
    return;
  }
#pragma omp parallel
  {
    // Static chunks of whole 64-byte lines: with 64-byte aligned arrays every chunk starts
    // aligned, and only the last one has a tail.
    const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t chunk = ((n + nt - 1) / nt + 15) / 16 * 16;
    const int64_t b = std::min(n, t * chunk), e = std::min(n, b + chunk);
    if (b < e) range(b, e);
  }
}

}  // namespace

bool adam_path_available(AdamPath p) { return p != AdamPath::Avx512 || cpu_has_avx512(); }
AdamPath adam_best_path() { return cpu_has_avx512() ? AdamPath::Avx512 : AdamPath::Scalar; }
const char* adam_path_name(AdamPath p) {
  switch (p) {
    case AdamPath::Auto: return "auto";
    case AdamPath::Scalar: return "scalar";
    case AdamPath::Avx512: return "avx512";
  }
  return "?";
}

void adam_step(float* w, float* m, float* v, const float* g, int64_t n, const AdamStepArgs& a,
               AdamPath path) {
  run(w, m, v, g, n, a, path);
}

void adam_step(float* w, float* m, float* v, const uint16_t* g, int64_t n, const AdamStepArgs& a,
               AdamPath path) {
  run(w, m, v, g, n, a, path);
}

}  // namespace sigma::cpu
