// Force-included (-include) ahead of src/kernels/cpu/gemv.cpp for the tests' second build of it
// (CMakeLists.txt, the *_avx512_emulated tests): its AVX-512 and AVX-512 VNNI kernels run on
// SIMDe's portable AVX-512 (Debian's libsimde-dev), with the native AVX2 and FMA beneath, so that
// the tests that compare every SIMD path with the portable path bit for bit check the AVX-512
// code on machines without AVX-512 too. SIMDe's FMA is the native fused one, so an emulated
// kernel computes each element as the hardware would; what SIMDe emulates is the lane layout,
// masks, unpacks, permutes and integer multiply-adds, which is where an AVX-512 kernel's bugs
// are.
#pragma once
#if defined(__AVX512F__)
#error "compile the AVX-512 emulation without AVX-512 (-mno-avx512f): it is meant for machines without it"
#endif
#include <immintrin.h>
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>

#define SIGMA_GEMV_EMULATED_AVX512 1

// SIMDe 0.7.4's alias of _mm512_madd_epi16 takes the masked form's four arguments.
#undef _mm512_madd_epi16
#define _mm512_madd_epi16(a, b) simde_mm512_madd_epi16(a, b)

// What SIMDe 0.7.4 lacks of the intrinsics gemv.cpp's AVX-512 code calls (GCC's own would need
// AVX-512): masked loads and stores, which touch only the lanes whose mask bit is set, as the
// hardware's do (so they read no byte past a row's end), a widening, and the 16-lane sum in
// GCC's order (halves added: 16 -> 8 -> 4, then lanes {0, 2} and {1, 3}, then the two).
#include <cstdint>
#include <cstring>

namespace sigma_avx512_emulation {

template <class T, int N, class Mask>
inline void masked_load(T (&lanes)[N], Mask k, const void* p) {
  for (int i = 0; i < N; ++i) {
    lanes[i] = T(0);
    if ((k >> i) & 1) std::memcpy(&lanes[i], static_cast<const char*>(p) + i * sizeof(T), sizeof(T));
  }
}
template <class T, int N, class Mask>
inline void masked_store(void* p, Mask k, const T (&lanes)[N]) {
  for (int i = 0; i < N; ++i)
    if ((k >> i) & 1) std::memcpy(static_cast<char*>(p) + i * sizeof(T), &lanes[i], sizeof(T));
}

inline simde__m512 maskz_loadu_ps(__mmask16 k, const void* p) {
  float v[16];
  masked_load(v, k, p);
  return simde_mm512_loadu_ps(v);
}
inline void mask_storeu_ps(void* p, __mmask16 k, simde__m512 a) {
  float v[16];
  simde_mm512_storeu_ps(v, a);
  masked_store(p, k, v);
}
inline simde__m512i maskz_loadu_epi32(__mmask16 k, const void* p) {
  int32_t v[16];
  masked_load(v, k, p);
  return simde_mm512_loadu_si512(v);
}
inline void mask_storeu_epi32(void* p, __mmask16 k, simde__m512i a) {
  int32_t v[16];
  simde_mm512_storeu_si512(v, a);
  masked_store(p, k, v);
}
inline __m256i maskz_loadu_epi16(__mmask16 k, const void* p) {
  int16_t v[16];
  masked_load(v, k, p);
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v));
}
inline __m256i maskz_loadu_epi8(__mmask32 k, const void* p) {
  int8_t v[32];
  masked_load(v, k, p);
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v));
}
inline simde__m512i cvtepu16_epi32(__m256i a) {
  uint16_t h[16];
  int32_t v[16];
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(h), a);
  for (int i = 0; i < 16; ++i) v[i] = int32_t(h[i]);
  return simde_mm512_loadu_si512(v);
}
inline float reduce_add_ps(simde__m512 a) {
  float v[16], h[8], q[4];
  simde_mm512_storeu_ps(v, a);
  for (int i = 0; i < 8; ++i) h[i] = v[i + 8] + v[i];
  for (int i = 0; i < 4; ++i) q[i] = h[i + 4] + h[i];
  return (q[0] + q[2]) + (q[1] + q[3]);
}

}  // namespace sigma_avx512_emulation

#define _mm512_maskz_loadu_ps sigma_avx512_emulation::maskz_loadu_ps
#define _mm512_mask_storeu_ps sigma_avx512_emulation::mask_storeu_ps
#define _mm512_maskz_loadu_epi32 sigma_avx512_emulation::maskz_loadu_epi32
#define _mm512_mask_storeu_epi32 sigma_avx512_emulation::mask_storeu_epi32
#define _mm256_maskz_loadu_epi16 sigma_avx512_emulation::maskz_loadu_epi16
#define _mm256_maskz_loadu_epi8 sigma_avx512_emulation::maskz_loadu_epi8
#define _mm512_cvtepu16_epi32 sigma_avx512_emulation::cvtepu16_epi32
#define _mm512_reduce_add_ps sigma_avx512_emulation::reduce_add_ps
