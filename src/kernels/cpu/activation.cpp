#include "kernels/cpu/activation.h"

#include <algorithm>
#include <cmath>

#include "kernels/cpu/matmul.h"
#include "kernels/cpu/parallel.h"
#include "kernels/cpu/vexp.h"

namespace sigma::cpu {

constexpr float kGeluAlpha = 1.702f;
constexpr int64_t kSigmoidChunk = 4096;  // sigmoid scratch per chunk stays in L1/L2

// s[0..m) is written by sigmoid_scaled (through AVX stores GCC 12 does not follow, and its
// AVX-512 intrinsics' _mm512_undefined_* merge sources: GCC bug 105593, as in adam.cpp).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
// In bf16 training y is registered in the bf16 mirror (Model::mirror): its copy is written here,
// each chunk while it is in L1, instead of by the next product re-reading y from memory.
void fast_gelu_forward(float* y, const float* x, int64_t n) {
  uint16_t* copy = bf16_mirror_claim(y, n);
  parallel_for((n + kSigmoidChunk - 1) / kSigmoidChunk, n * kExpMacs > kParallelMacs, [&](int64_t k) {
    const int64_t c = k * kSigmoidChunk, m = std::min(kSigmoidChunk, n - c);
    float s[kSigmoidChunk];
    sigmoid_scaled(s, x + c, m, kGeluAlpha);
    for (int64_t i = 0; i < m; ++i) y[c + i] = x[c + i] * s[i];
    if (copy) row_to_bf16(copy + c, y + c, m);
  });
}

void fast_gelu_backward(float* dx, const float* dy, const float* x, int64_t n) {
  parallel_for((n + kSigmoidChunk - 1) / kSigmoidChunk, n * kExpMacs > kParallelMacs, [&](int64_t k) {
    const int64_t c = k * kSigmoidChunk, m = std::min(kSigmoidChunk, n - c);
    float s[kSigmoidChunk];
    sigmoid_scaled(s, x + c, m, kGeluAlpha);
    for (int64_t i = 0; i < m; ++i) {
      const float xi = x[c + i];
      dx[c + i] = dy[c + i] * (s[i] + kGeluAlpha * xi * s[i] * (1.0f - s[i]));
    }
  });
}

#pragma GCC diagnostic pop

}  // namespace sigma::cpu
