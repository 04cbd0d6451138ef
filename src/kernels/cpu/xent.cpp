#include "kernels/cpu/xent.h"

#include <algorithm>
#include <cmath>

namespace sigma::cpu {

void softmax_xent(float* logits, float* loss, const int32_t* targets, const float* grad_scale,
                  int64_t N, int64_t V) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < N; ++i) {
    float* row = logits + i * V;
    float mx = row[0];
    for (int64_t j = 1; j < V; ++j) mx = std::max(mx, row[j]);
    float sum = 0.0f;
    for (int64_t j = 0; j < V; ++j) sum += std::exp(row[j] - mx);
    const float logz = mx + std::log(sum);
    loss[i] = logz - row[targets[i]];
    if (!grad_scale) continue;
    const float g = grad_scale[i];
    if (g == 0.0f) {
      std::fill(row, row + V, 0.0f);
      continue;
    }
    for (int64_t j = 0; j < V; ++j) row[j] = std::exp(row[j] - logz) * g;
    row[targets[i]] -= g;
  }
}

}  // namespace sigma::cpu
