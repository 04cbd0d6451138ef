// Counter-based RNG: every random number is a pure function of (seed, stream, index), so
// results do not depend on thread count or on the order in which values are drawn.
#pragma once
#include <cmath>
#include <cstdint>

namespace sigma {

// SplitMix64 finaliser: a bijective 64-bit mixer with good avalanche.
inline uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

inline uint64_t rng_u64(uint64_t seed, uint64_t stream, uint64_t index) {
  return mix64(mix64(seed ^ mix64(stream)) + index);
}

// Uniform in [0, 1) with 24 bits.
inline float rng_uniform(uint64_t seed, uint64_t stream, uint64_t index) {
  return static_cast<float>(rng_u64(seed, stream, index) >> 40) * (1.0f / 16777216.0f);
}

// Standard normal by Box-Muller on two counters.
inline float rng_normal(uint64_t seed, uint64_t stream, uint64_t index) {
  uint64_t r = rng_u64(seed, stream, index);
  double u1 = (static_cast<double>(r >> 11) + 1.0) * (1.0 / 9007199254740994.0);  // (0, 1]
  double u2 = static_cast<double>(rng_u64(seed, stream ^ 0x5bd1e995ULL, index) >> 11) *
              (1.0 / 9007199254740992.0);
  return static_cast<float>(std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
}

// A sequential generator over the same counter scheme, for code that draws in order.
struct Rng {
  uint64_t seed, stream, index = 0;
  Rng(uint64_t seed_, uint64_t stream_) : seed(seed_), stream(stream_) {}
  uint64_t next_u64() { return rng_u64(seed, stream, index++); }
  float normal() { return rng_normal(seed, stream, index++); }
  // Uniform integer in [0, n), n > 0 (rejection-free multiply-shift; bias < 2^-32 for small n).
  uint32_t below(uint32_t n) {
    return static_cast<uint32_t>(((next_u64() >> 32) * static_cast<uint64_t>(n)) >> 32);
  }
};

// Hashes a string to a stream id, so named parameters get independent streams.
inline uint64_t stream_of(const char* s) {
  uint64_t h = 1469598103934665603ULL;
  for (; *s; ++s) h = (h ^ static_cast<unsigned char>(*s)) * 1099511628211ULL;
  return mix64(h);
}

}  // namespace sigma
