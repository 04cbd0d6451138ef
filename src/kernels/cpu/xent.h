#pragma once
#include <cstdint>

#include "kernels/cpu/contract.h"

namespace sigma::cpu {

// Softmax cross-entropy over rows of logits[N,V] (fp32, max-subtracted).
// loss[i] = -log softmax(logits_i)[target_i] for every row (mask ignored here).
// If grad_scale is non-null, logits are OVERWRITTEN with the gradient
// (softmax - onehot) * grad_scale[i]; rows with grad_scale 0 become zero.
void softmax_xent(float* logits, float* loss, const int32_t* targets, const float* grad_scale,
                  int64_t N, int64_t V);

// Vocabulary-parallel softmax cross-entropy (tensor parallelism, model/tensor_parallel.h):
// a rank holds logits[N, V] for the columns [v0, v0 + V) of each row's vocabulary, and the
// full rows exist nowhere. Part 1, this rank's statistics, row by row:
//   stats[i] = {max_j l_ij, sum_j exp(l_ij - max), l_i,target (0 when target_i is not in
//   [v0, v0 + V))}; logits are not changed.
// Part 2, from the P ranks' stats[P, N, 3] (rank order, the same on every rank):
//   M = max_r max_r, S = sum_r sum_r * exp(max_r - M) in double (r ascending), and
//   loss[i] = M + log S - (sum_r target_r); with grad_scale the logits are OVERWRITTEN with
//   (exp(l - M) / S - onehot) * grad_scale[i], the onehot only at this rank's target column.
void xent_partial(float* stats, const float* logits, const int32_t* targets, int64_t v0,
                  int64_t N, int64_t V);
void xent_combine(float* logits, float* loss, const float* stats, const int32_t* targets,
                  const float* grad_scale, int64_t v0, int64_t P, int64_t N, int64_t V);

}  // namespace sigma::cpu
