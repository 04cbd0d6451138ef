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

template <class T, int N>
struct Lanes {
  T v[N];
};
template <class T, int N, class Mask>
inline Lanes<T, N> masked_load(Mask k, const void* p) {
  Lanes<T, N> l{};
  for (int i = 0; i < N; ++i)
    if ((k >> i) & 1) std::memcpy(&l.v[i], static_cast<const char*>(p) + i * sizeof(T), sizeof(T));
  return l;
}
template <class T, int N, class Mask>
inline void masked_store(void* p, Mask k, const Lanes<T, N>& l) {
  for (int i = 0; i < N; ++i)
    if ((k >> i) & 1) std::memcpy(static_cast<char*>(p) + i * sizeof(T), &l.v[i], sizeof(T));
}
template <class T, int N, class V>
inline Lanes<T, N> lanes(V a) {
  static_assert(sizeof(V) == sizeof(Lanes<T, N>));
  Lanes<T, N> l;
  std::memcpy(l.v, &a, sizeof(a));
  return l;
}

inline simde__m512 maskz_loadu_ps(__mmask16 k, const void* p) {
  return simde_mm512_loadu_ps(masked_load<float, 16>(k, p).v);
}
inline simde__m512i maskz_loadu_epi32(__mmask16 k, const void* p) {
  return simde_mm512_loadu_si512(masked_load<int32_t, 16>(k, p).v);
}
inline __m256i maskz_loadu_epi16(__mmask16 k, const void* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(masked_load<int16_t, 16>(k, p).v));
}
inline __m256i maskz_loadu_epi8(__mmask32 k, const void* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(masked_load<int8_t, 32>(k, p).v));
}
inline void mask_storeu_ps(void* p, __mmask16 k, simde__m512 a) { masked_store(p, k, lanes<float, 16>(a)); }
inline void mask_storeu_epi32(void* p, __mmask16 k, simde__m512i a) { masked_store(p, k, lanes<int32_t, 16>(a)); }
inline simde__m512i cvtepu16_epi32(__m256i a) {
  const Lanes<uint16_t, 16> h = lanes<uint16_t, 16>(a);
  int32_t v[16];
  for (int i = 0; i < 16; ++i) v[i] = int32_t(h.v[i]);
  return simde_mm512_loadu_si512(v);
}
inline float reduce_add_ps(simde__m512 a) {
  const Lanes<float, 16> v = lanes<float, 16>(a);
  float h[8], q[4];
  for (int i = 0; i < 8; ++i) h[i] = v.v[i + 8] + v.v[i];
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
