#pragma once
#include <cstdint>

#include "kernels/cpu/contract.h"
#include "kernels/types.h"

namespace sigma::cpu {

using kernels::kLayerNormEps;

// out[N,C] = (x - mean) * rstd * w + b per row; saves mean[N], rstd[N].
void layernorm_forward(float* out, float* mean, float* rstd, const float* x, const float* w,
                       const float* b, int64_t N, int64_t C);

// dx += ..., dw += ..., db += ...
void layernorm_backward(float* dx, float* dw, float* db, const float* dout, const float* x,
                        const float* mean, const float* rstd, const float* w, int64_t N,
                        int64_t C);

}  // namespace sigma::cpu
