#pragma once
#include <cstdint>

#include "kernels/cpu/contract.h"

namespace sigma::cpu {

// out[b,t,:] = table[rows[b*T+t], :] + pos[t, :]   (rows already include the slot offset).
// A row < 0 reads as zeros, and pos may be null (no position added): a vocabulary-parallel
// table (model/tensor_parallel.h) looks up only the rows this rank holds.
void embedding_forward(float* out, const int32_t* rows, const float* table, const float* pos,
                       int64_t B, int64_t T, int64_t d);

// dtable[rows[i]] += dout[i]; dpos[t] += sum_b dout[b,t]. dtable rows are summed in token order;
// a row < 0 is skipped.
void embedding_backward(float* dtable, float* dpos, const float* dout, const int32_t* rows,
                        int64_t B, int64_t T, int64_t d);

}  // namespace sigma::cpu
