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

}  // namespace sigma::cpu
