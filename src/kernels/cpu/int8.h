// Weight-only int8 for inference (Model::use_weights; the products are in gemv.h): symmetric
// quantisation with one scale per output channel, and the embedding lookups on the tables that
// replace the fp32 ones in a served model (bf16 or int8).
#pragma once
#include <cstdint>

namespace sigma::cpu {

// q, scale[per_row ? rows : cols] from w[rows, cols] (rows ld apart): q[rows, cols] per row, or
// in panels of row pairs per column (kernels::i8_index; i8_elements(rows, cols) bytes). Per channel,
// scale = max |w| / 127 and q = w / scale rounded to nearest even, so |w - scale * q| <=
// scale / 2 and the largest weight maps to +-127 exactly. A channel of zeros gets scale 0
// and q 0; a channel holding a NaN or an infinity gets scale 0 and q 0 too, and the count of
// such weights is returned (the caller names the tensor).
int64_t quantize_i8(int8_t* q, float* scale, const float* w, int64_t rows, int64_t cols,
                    int64_t ld, bool per_row);

// out[b,t,:] = widen(table[rows[b*T+t], :]) + pos[t, :]: a bf16 table (exact widening), or an
// int8 table with a scale per row (scale[row] * q[row, :]).
void embedding_forward_w16(float* out, const int32_t* rows, const uint16_t* table,
                           const float* pos, int64_t B, int64_t T, int64_t d);
void embedding_forward_i8(float* out, const int32_t* rows, const int8_t* q, const float* scale,
                          const float* pos, int64_t B, int64_t T, int64_t d);

}  // namespace sigma::cpu
