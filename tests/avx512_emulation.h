// Force-included (-include) ahead of the kernels that have AVX-512 code, and the tests that call
// them, for the tests' second build of them (CMakeLists.txt, the *_avx512_emulated tests): their
// AVX-512 code runs on SIMDe's portable AVX-512 (Debian's libsimde-dev), with the native AVX2 and
// FMA beneath, so that the tests that compare the SIMD paths with the portable path check the
// AVX-512 code on machines without AVX-512 too. SIMDe's FMA is the native fused one, so an
// emulated kernel computes each element as the hardware would; what SIMDe emulates is the lane
// layout, masks, unpacks, permutes and integer multiply-adds, which is where an AVX-512 kernel's
// bugs are. Two kinds of AVX-512 code take it: the run-time dispatched kernels (gemv.cpp,
// adam.cpp: SIGMA_EMULATED_AVX512 drops their target attributes and makes the CPU "have" the
// ISA), and the code an AVX-512 build compiles in place of the AVX2 code (attention.cpp, vexp.h,
// bf16_vec.h, matmul.cpp), for which this header defines the compiler's AVX-512 macros once
// SIMDe has read them.
#pragma once
#if defined(__AVX512F__)
#error "compile the AVX-512 emulation without AVX-512 (-mno-avx512f): it is meant for machines without it"
#endif
#include <immintrin.h>
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>

#define SIGMA_EMULATED_AVX512 1
// What a Zen 4 or Zen 5 build (-march=native) defines; SIMDe above has seen none of them, so it
// emulates rather than calling the hardware's intrinsics.
#define __AVX512F__ 1
#define __AVX512BW__ 1
#define __AVX512BF16__ 1

// SIMDe 0.7.4's alias of _mm512_madd_epi16 takes the masked form's four arguments.
#undef _mm512_madd_epi16
#define _mm512_madd_epi16(a, b) simde_mm512_madd_epi16(a, b)

// What SIMDe 0.7.4 lacks of the intrinsics the kernels' AVX-512 code calls (GCC's own would need
// AVX-512), each written from its description in Intel's intrinsics guide: masked loads and
// stores, which touch only the lanes whose mask bit is set, as the hardware's do (so they read no
// byte past a row's end), a widening and a narrowing, unsigned compares into a mask, the 16-lane
// sum and maximum in GCC's order (halves combined: 16 -> 8 -> 4, then lanes {0, 2} and {1, 3},
// then the two), and vcvtneps2bf16 (nearest even; a NaN quieted; a subnormal input read as zero).
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
inline __m256i cvtepi32_epi16(simde__m512i a) {  // vpmovdw: each lane's low 16 bits
  const Lanes<int32_t, 16> w = lanes<int32_t, 16>(a);
  int16_t v[16];
  for (int i = 0; i < 16; ++i) v[i] = int16_t(uint32_t(w.v[i]) & 0xffff);
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v));
}
inline __mmask16 mask_cmplt_epu32_mask(__mmask16 k, simde__m512i a, simde__m512i b) {
  const Lanes<uint32_t, 16> x = lanes<uint32_t, 16>(a), y = lanes<uint32_t, 16>(b);
  unsigned m = 0;
  for (int i = 0; i < 16; ++i) m |= unsigned(((k >> i) & 1) && x.v[i] < y.v[i]) << i;
  return __mmask16(m);
}
inline __mmask16 cmpgt_epu32_mask(simde__m512i a, simde__m512i b) { return mask_cmplt_epu32_mask(0xffff, b, a); }
inline __m256i cvtneps_pbh(simde__m512 a) {
  const Lanes<uint32_t, 16> x = lanes<uint32_t, 16>(a);
  uint16_t v[16];
  for (int i = 0; i < 16; ++i) {
    uint32_t b = x.v[i];
    if ((b & 0x7fffffffu) > 0x7f800000u) {
      v[i] = uint16_t((b >> 16) | 0x40);
      continue;
    }
    if ((b & 0x7f800000u) == 0) b &= 0x80000000u;  // a subnormal is read as zero
    v[i] = uint16_t((b + 0x7fffu + ((b >> 16) & 1)) >> 16);
  }
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v));
}
inline float reduce_max_ps(simde__m512 a) {  // _mm_max_ps keeps its second operand on a NaN
  const Lanes<float, 16> v = lanes<float, 16>(a);
  const __m256 t3 = _mm256_max_ps(_mm256_loadu_ps(v.v + 8), _mm256_loadu_ps(v.v));
  const __m128 t6 = _mm_max_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
  const __m128 t8 = _mm_max_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(_mm_max_ps(t8, _mm_shuffle_ps(t8, t8, _MM_SHUFFLE(0, 1, 0, 1))));
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
#define _mm512_reduce_max_ps sigma_avx512_emulation::reduce_max_ps
#define _mm512_cvtepi32_epi16 sigma_avx512_emulation::cvtepi32_epi16
#define _mm512_cmpgt_epu32_mask sigma_avx512_emulation::cmpgt_epu32_mask
#define _mm512_mask_cmplt_epu32_mask sigma_avx512_emulation::mask_cmplt_epu32_mask
#define _mm512_cvtneps_pbh sigma_avx512_emulation::cvtneps_pbh
