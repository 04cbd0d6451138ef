// bf16 <-> fp32 by bit manipulation: bf16 is the top half of an fp32 word.
#pragma once
#include <cstdint>
#include <cstring>

namespace sigma {

// Rounds to nearest, ties to even (NaN payloads are not preserved).
inline uint16_t to_bf16(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  b += 0x7fffu + ((b >> 16) & 1u);
  return uint16_t(b >> 16);
}

// Exact: every bf16 value is an fp32 value.
inline float from_bf16(uint16_t h) {
  const uint32_t b = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

}  // namespace sigma
