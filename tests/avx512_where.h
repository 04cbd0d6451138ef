// What the tests that name the SIMD paths they ran append to "avx512": where its code ran.
#pragma once

namespace sigma::testing {

#if defined(SIGMA_EMULATED_AVX512)  // the *_avx512_emulated tests (tests/avx512_emulation.h)
inline constexpr const char* kAvx512Where = " (AVX-512 on SIMDe's emulation)";
#else
inline constexpr const char* kAvx512Where = "";
#endif

}  // namespace sigma::testing
