// bf16 <-> fp32 by bit manipulation: bf16 is the top half of an fp32 word.
#pragma once
#include <cstdint>
#include <cstring>

namespace sigma {

// Rounds to nearest, ties to even; overflow rounds to infinity as in IEEE. A NaN stays a NaN
// (quieted, sign kept): rounding its bits could otherwise carry into the exponent and give an
// infinity, or drop every payload bit and give one.
inline uint16_t to_bf16(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  if ((b & 0x7fffffffu) > 0x7f800000u) return uint16_t((b >> 16) | 0x0040u);
  b += 0x7fffu + ((b >> 16) & 1u);
  return uint16_t(b >> 16);
}

// The fp32 value nearest to f that bf16 can hold (to_bf16 then from_bf16).
inline float round_bf16(float f);

// Exact: every bf16 value is an fp32 value.
inline float from_bf16(uint16_t h) {
  const uint32_t b = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

inline float round_bf16(float f) { return from_bf16(to_bf16(f)); }

}  // namespace sigma
