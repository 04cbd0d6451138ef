#include "kernels/cpu/activation.h"

#include <cmath>

namespace sigma::cpu {

constexpr float kGeluAlpha = 1.702f;

void fast_gelu_forward(float* y, const float* x, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] / (1.0f + std::exp(-kGeluAlpha * x[i]));
}

void fast_gelu_backward(float* dx, const float* dy, const float* x, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float s = 1.0f / (1.0f + std::exp(-kGeluAlpha * x[i]));
    dx[i] += dy[i] * (s + kGeluAlpha * x[i] * s * (1.0f - s));
  }
}

}  // namespace sigma::cpu
