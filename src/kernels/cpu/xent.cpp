#include "kernels/cpu/xent.h"

#include <algorithm>
#include <cmath>

#include "kernels/cpu/matmul.h"
#include "kernels/cpu/parallel.h"
#include "kernels/cpu/vexp.h"

namespace sigma::cpu {

// In bf16 training dL/dlogits is registered in the bf16 mirror (Model::head): each row's copy
// is written here while the row is in L2, instead of by the next product reading it back.
void softmax_xent(float* logits, float* loss, const int32_t* targets, const float* grad_scale,
                  int64_t N, int64_t V) {
  uint16_t* copy = grad_scale ? bf16_mirror_claim(logits, N * V) : nullptr;
  parallel_for(N, N * V > kParallelFloats, [&](int64_t i) {
    float* row = logits + i * V;
    const float target_logit = row[targets[i]];
    const float mx = max_of(row, V);
    if (!grad_scale) {  // loss only: a copy-free sum, in double so that small terms count
      double sum = 0.0;
      for (int64_t j = 0; j < V; ++j) sum += double(std::exp(row[j] - mx));
      loss[i] = float(double(mx) + std::log(sum) - double(target_logit));
      return;
    }
    const float sum = exp_shift_sum(row, V, mx);  // row now holds exp(logit - max)
    loss[i] = mx + std::log(sum) - target_logit;
    const float g = grad_scale[i];
    scale_into(row, row, V, g / sum);  // softmax * g; zero rows when g = 0
    row[targets[i]] -= g;
    if (copy) row_to_bf16(copy + i * V, row, V);
  });
}

namespace {
// The combined statistics of row i: M, S and the target logit.
struct RowStats {
  double max, sum, target;
};
RowStats combine_row(const float* stats, int64_t i, int64_t P, int64_t N) {
  double M = stats[i * 3];
  for (int64_t r = 1; r < P; ++r) M = std::max(M, double(stats[(r * N + i) * 3]));
  RowStats s{M, 0.0, 0.0};
  for (int64_t r = 0; r < P; ++r) {
    const float* x = stats + (r * N + i) * 3;
    s.sum += double(x[1]) * std::exp(double(x[0]) - M);
    s.target += double(x[2]);
  }
  return s;
}
}  // namespace

void xent_partial(float* stats, const float* logits, const int32_t* targets, int64_t v0,
                  int64_t N, int64_t V) {
  parallel_for(N, N * V > kParallelFloats, [&](int64_t i) {
    const float* row = logits + i * V;
    const float mx = max_of(row, V);
    double sum = 0.0;
    for (int64_t j = 0; j < V; ++j) sum += double(std::exp(row[j] - mx));
    const int64_t t = int64_t(targets[i]) - v0;
    stats[i * 3] = mx;
    stats[i * 3 + 1] = float(sum);
    stats[i * 3 + 2] = t >= 0 && t < V ? row[t] : 0.0f;
  });
}

void xent_combine(float* logits, float* loss, const float* stats, const int32_t* targets,
                  const float* grad_scale, int64_t v0, int64_t P, int64_t N, int64_t V) {
  parallel_for(N, N * V > kParallelFloats, [&](int64_t i) {
    const RowStats s = combine_row(stats, i, P, N);
    loss[i] = float(s.max + std::log(s.sum) - s.target);
    if (!grad_scale) return;
    float* row = logits + i * V;
    const float g = grad_scale[i];
    const float M = float(s.max), f = float(double(g) / s.sum);
    for (int64_t j = 0; j < V; ++j) row[j] = std::exp(row[j] - M) * f;
    const int64_t t = int64_t(targets[i]) - v0;
    if (t >= 0 && t < V) row[t] -= g;
  });
}

}  // namespace sigma::cpu
