// ref: the ops on bf16 weight copies (linear_forward_w16, gemm_nt_w16; see ref/io.h for the
// rules). A bf16 weight is an exact fp32 value, so the formulas are linear_forward's and the
// head's product over the widened weights.
#pragma once
#include "core/bf16.h"
#include "kernels/ref/io.h"

namespace sigma::ref {

// y = (accumulate ? y : 0) + b + x w16.
template <class T>
void linear_forward_w16(float* y, const float* x, const uint16_t* w16, const float* b, int64_t N,
                        int64_t in, int64_t out, bool accumulate, Strides ld) {
  const int64_t ldx = ld.x ? ld.x : in, ldw = ld.w ? ld.w : out, ldy = ld.y ? ld.y : out;
  for (int64_t i = 0; i < N; ++i)
    for (int64_t j = 0; j < out; ++j) {
      T s = accumulate ? T(y[i * ldy + j]) : T(0);
      if (b) s += T(b[j]);
      for (int64_t k = 0; k < in; ++k) s += T(x[i * ldx + k]) * T(from_bf16(w16[k * ldw + j]));
      store<T>(y + i * ldy + j, s);
    }
}

// y[i, j] = sum_k x[i, k] w16[j, k].
template <class T>
void gemm_nt_w16(float* y, const float* x, const uint16_t* w16, int64_t N, int64_t in,
                 int64_t out, int64_t ldx, int64_t ldw, int64_t ldy) {
  for (int64_t i = 0; i < N; ++i)
    for (int64_t j = 0; j < out; ++j) {
      T s = 0;
      for (int64_t k = 0; k < in; ++k) s += T(x[i * ldx + k]) * T(from_bf16(w16[j * ldw + k]));
      store<T>(y + i * ldy + j, s);
    }
}

}  // namespace sigma::ref
