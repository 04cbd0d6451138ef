#include "kernels/cpu/movement.h"

#include <omp.h>

#include <algorithm>
#include <cstring>

#include "kernels/cpu/parallel.h"

namespace sigma::cpu {

void copy(float* dst, const float* src, int64_t n) {
  if (n > 0) std::memcpy(dst, src, size_t(n) * sizeof(float));
}

void copy_bytes(void* dst, const void* src, size_t bytes) {
  if (bytes) std::memcpy(dst, src, bytes);
}

// Large fills (a step's gradients and accumulators: hundreds of MB) on the team: one thread's
// stores do not reach the memory's write bandwidth, and the other thread would wait idle.
void fill(float* dst, float value, int64_t n) {
  constexpr int64_t kChunk = int64_t(1) << 16;
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  parallel_for(chunks, n > kParallelFloats && !omp_in_parallel(), [&](int64_t c) {
    std::fill(dst + c * kChunk, dst + std::min(n, (c + 1) * kChunk), value);
  });
}

void add_into(float* dst, const float* src, int64_t n) {
  parallel_for(n, n > kParallelFloats, [&](int64_t i) { dst[i] += src[i]; });
}

void gather_rows(float* dst, const float* src, const int32_t* order, int64_t N, int64_t d) {
  parallel_for(N, N * d > kParallelFloats, [&](int64_t j) {
    std::memcpy(dst + j * d, src + int64_t(order[j]) * d, size_t(d) * sizeof(float));
  });
}

void scatter_rows(float* dst, const float* src, const int32_t* order, int64_t N, int64_t d,
                  bool accumulate) {
  parallel_for(N, N * d > kParallelFloats, [&](int64_t j) {
    float* out = dst + int64_t(order[j]) * d;
    const float* in = src + j * d;
    if (accumulate)
      for (int64_t c = 0; c < d; ++c) out[c] += in[c];
    else
      std::memcpy(out, in, size_t(d) * sizeof(float));
  });
}

}  // namespace sigma::cpu
