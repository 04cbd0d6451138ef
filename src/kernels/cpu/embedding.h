#pragma once
#include <cstdint>

#include "kernels/cpu/contract.h"

namespace sigma::cpu {

// out[b,t,:] = table[rows[b*T+t], :] + pos[t, :]   (rows already include the slot offset)
void embedding_forward(float* out, const int32_t* rows, const float* table, const float* pos,
                       int64_t B, int64_t T, int64_t d);

// dtable[rows[i]] += dout[i]; dpos[t] += sum_b dout[b,t]. dtable rows are summed in token order.
void embedding_backward(float* dtable, float* dpos, const float* dout, const int32_t* rows,
                        int64_t B, int64_t T, int64_t d);

}  // namespace sigma::cpu
