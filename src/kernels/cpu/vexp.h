// Vectorised exp for the softmax, cross-entropy and FastGelu loops. glibc's expf is scalar
// under -O3 without -ffast-math (~5 ns a call; ~300 M calls per step of the benchmark model),
// so these loops use a 16-lane AVX-512 version where the build has it (else an 8-lane AVX2 one,
// the same polynomial), with a scalar tail.
// exp(x) = 2^n * e^r, n = round(x / ln 2), |r| <= ln2/2, e^r by its degree-7 Taylor polynomial
// (relative error < 1e-8, below fp32 rounding); _mm512_scalef_ps applies 2^n with correct
// overflow/underflow.
#pragma once
#include <cmath>
#include <cstdint>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define SIGMA_VEXP_AVX2 1
#endif

namespace sigma::cpu {

// Which of the loops below this build has (the tests print it).
#if defined(__AVX512F__)
constexpr const char* kVectorExpPath = "avx512";
#elif defined(SIGMA_VEXP_AVX2)
constexpr const char* kVectorExpPath = "avx2";
#else
constexpr const char* kVectorExpPath = "scalar";
#endif

#if defined(__AVX512F__)
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.7f)), _mm512_set1_ps(-103.9f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // ln2 split in two parts
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}
#endif

#if defined(SIGMA_VEXP_AVX2)
// exp16's steps on 8 lanes; 2^n (n in [-150, 128]) as two exact powers of two, each in the
// normal range, so that overflow and underflow round once as with scalef.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.7f)), _mm256_set1_ps(-103.9f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 5040);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i ni = _mm256_cvtps_epi32(n), n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
  const __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
}

inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

inline float max8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
#endif

// x[i] = exp(x[i] - shift); returns the sum of the new values (summed in a fixed order).
inline float exp_shift_sum(float* x, int64_t n, float shift) {
  int64_t i = 0;
  float sum = 0.0f;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  const __m512 s = _mm512_set1_ps(shift);
  for (; i + 16 <= n; i += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(x + i), s));
    _mm512_storeu_ps(x + i, e);
    acc = _mm512_add_ps(acc, e);
  }
  sum = _mm512_reduce_add_ps(acc);
#elif defined(SIGMA_VEXP_AVX2)
  __m256 acc = _mm256_setzero_ps();
  const __m256 s = _mm256_set1_ps(shift);
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), s));
    _mm256_storeu_ps(x + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  sum = sum8(acc);
#endif
  for (; i < n; ++i) sum += x[i] = std::exp(x[i] - shift);
  return sum;
}

// y[i] = x[i] * s
inline void scale_into(float* y, const float* x, int64_t n, float s) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] * s;
}

// Largest value of x[0..n).
inline float max_of(const float* x, int64_t n) {
  float m = x[0];
  int64_t i = 0;
#if defined(__AVX512F__)
  if (n >= 16) {
    __m512 acc = _mm512_loadu_ps(x);
    for (i = 16; i + 16 <= n; i += 16) acc = _mm512_max_ps(acc, _mm512_loadu_ps(x + i));
    m = _mm512_reduce_max_ps(acc);
  }
#elif defined(SIGMA_VEXP_AVX2)
  if (n >= 8) {
    __m256 acc = _mm256_loadu_ps(x);
    for (i = 8; i + 8 <= n; i += 8) acc = _mm256_max_ps(acc, _mm256_loadu_ps(x + i));
    m = max8(acc);
  }
#endif
  for (; i < n; ++i) m = m > x[i] ? m : x[i];
  return m;
}

// sigmoid(a * x[i]) for FastGelu, into s[i].
inline void sigmoid_scaled(float* s, const float* x, int64_t n, float a) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 na = _mm512_set1_ps(-a), one = _mm512_set1_ps(1.0f);
  for (; i + 16 <= n; i += 16) {
    const __m512 e = exp16(_mm512_mul_ps(na, _mm512_loadu_ps(x + i)));
    _mm512_storeu_ps(s + i, _mm512_div_ps(one, _mm512_add_ps(one, e)));
  }
#elif defined(SIGMA_VEXP_AVX2)
  const __m256 na = _mm256_set1_ps(-a), one = _mm256_set1_ps(1.0f);
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp8(_mm256_mul_ps(na, _mm256_loadu_ps(x + i)));
    _mm256_storeu_ps(s + i, _mm256_div_ps(one, _mm256_add_ps(one, e)));
  }
#endif
  for (; i < n; ++i) s[i] = 1.0f / (1.0f + std::exp(-a * x[i]));
}

}  // namespace sigma::cpu
