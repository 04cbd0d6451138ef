#pragma once
#include <cstdint>

#include "kernels/cpu/contract.h"

namespace sigma::cpu {

// FastGelu (PanGu-α): y = x * sigmoid(1.702 x), elementwise over n values.
void fast_gelu_forward(float* y, const float* x, int64_t n);
// dx = dy * (s + 1.702 x s (1 - s)), s = sigmoid(1.702 x); dx may be dy
void fast_gelu_backward(float* dx, const float* dy, const float* x, int64_t n);

}  // namespace sigma::cpu
