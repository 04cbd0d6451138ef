// fp32 -> bf16 on 16 AVX-512 lanes with sigma::to_bf16's bits (core/bf16.h): for the row
// conversions of matmul.cpp and the fused softmax rows of attention.cpp.
#pragma once
#if defined(__AVX512F__) && defined(__AVX512BW__)
// GCC 12 reports its own _mm512_undefined_*() in the intrinsic headers as maybe-uninitialized
// (GCC bug 105593, as in adam.cpp); the values are never read.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

namespace sigma::cpu {

// to_bf16's integer rounding: nearest even; a NaN keeps its top bits and is quieted.
inline __m256i bf16x16_int(__m512i b) {
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
  const __m512i half = _mm512_set1_epi32(0x7fff), one = _mm512_set1_epi32(1),
                quiet = _mm512_set1_epi32(0x0040);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(b, abs_mask), inf);
  const __m512i top = _mm512_srli_epi32(b, 16);
  const __m512i odd = _mm512_and_si512(top, one);
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(half, odd)), 16);
  r = _mm512_mask_or_epi32(r, nan, top, quiet);
  return _mm512_cvtepi32_epi16(r);
}

// With avx512_bf16, vcvtneps2bf16 rounds the same way in one instruction but reads subnormal
// inputs as zero: a vector holding one takes the integer path.
inline __m256i bf16x16(__m512 x) {
#if defined(__AVX512BF16__)
  const __m512i a = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7fffffff));
  if (_mm512_mask_cmplt_epu32_mask(_mm512_test_epi32_mask(a, a), a,
                                   _mm512_set1_epi32(0x00800000)) == 0)
    return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x));
#endif
  return bf16x16_int(_mm512_castps_si512(x));
}

}  // namespace sigma::cpu
#endif
