#include "kernels/cpu/movement.h"

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

void fill(float* dst, float value, int64_t n) {
  if (n > 0) std::fill(dst, dst + n, value);
}

void add_into(float* dst, const float* src, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n > kParallelFloats)
  for (int64_t i = 0; i < n; ++i) dst[i] += src[i];
}

void gather_rows(float* dst, const float* src, const int32_t* order, int64_t N, int64_t d) {
#pragma omp parallel for schedule(static) if (N * d > kParallelFloats)
  for (int64_t j = 0; j < N; ++j)
    std::memcpy(dst + j * d, src + int64_t(order[j]) * d, size_t(d) * sizeof(float));
}

void scatter_rows(float* dst, const float* src, const int32_t* order, int64_t N, int64_t d,
                  bool accumulate) {
#pragma omp parallel for schedule(static) if (N * d > kParallelFloats)
  for (int64_t j = 0; j < N; ++j) {
    float* out = dst + int64_t(order[j]) * d;
    const float* in = src + j * d;
    if (accumulate)
      for (int64_t c = 0; c < d; ++c) out[c] += in[c];
    else
      std::memcpy(out, in, size_t(d) * sizeof(float));
  }
}

}  // namespace sigma::cpu
