// The benchmarks' probes (stream_probe, fma_peak, bench_gemv's read) in GCC's generic vectors
// of the machine's widest registers: 16 floats with AVX-512, 8 with AVX2. An AVX-512 intrinsic
// does not compile on an AVX2 machine, and a 64-byte generic vector there goes through the
// stack; one native register per vector does neither.
#pragma once
#include <cstring>

namespace sigma::bench {

#if defined(__AVX512F__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
using vfloat = float __attribute__((vector_size(kLanes * 4)));

inline vfloat load(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store(float* p, vfloat v) { std::memcpy(p, &v, sizeof v); }
inline vfloat splat(float x) { return vfloat{} + x; }
inline float sum(vfloat v) {
  float s = 0;
  for (int l = 0; l < kLanes; ++l) s += v[l];
  return s;
}
// s[0..3] += the 64 floats at p, one register at a time, round robin over the four sums.
inline void add64(vfloat s[4], const float* p) {
  for (int c = 0; c < 64 / kLanes; ++c) s[c % 4] += load(p + c * kLanes);
}

}  // namespace sigma::bench
