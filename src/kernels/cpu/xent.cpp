#include "kernels/cpu/xent.h"

#include <algorithm>
#include <cmath>

#include "kernels/cpu/parallel.h"
#include "kernels/cpu/vexp.h"

namespace sigma::cpu {

void softmax_xent(float* logits, float* loss, const int32_t* targets, const float* grad_scale,
                  int64_t N, int64_t V) {
#pragma omp parallel for schedule(static) if (N * V > kParallelFloats)
  for (int64_t i = 0; i < N; ++i) {
    float* row = logits + i * V;
    const float target_logit = row[targets[i]];
    const float mx = max_of(row, V);
    if (!grad_scale) {  // loss only: a copy-free sum, in double so that small terms count
      double sum = 0.0;
      for (int64_t j = 0; j < V; ++j) sum += double(std::exp(row[j] - mx));
      loss[i] = float(double(mx) + std::log(sum) - double(target_logit));
      continue;
    }
    const float sum = exp_shift_sum(row, V, mx);  // row now holds exp(logit - max)
    loss[i] = mx + std::log(sum) - target_logit;
    const float g = grad_scale[i];
    scale_into(row, row, V, g / sum);  // softmax * g; zero rows when g = 0
    row[targets[i]] -= g;
  }
}

}  // namespace sigma::cpu
