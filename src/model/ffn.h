// The position-wise FFN, d -> f (FastGelu) -> d, as free functions over raw pointers so the
// dense block and each RRE expert run the same code on their own rows.
#pragma once
#include <cstdint>

#include "kernels/types.h"

namespace sigma {

// One weight matrix [in, out] as the forward reads it: its fp32 values (v), or the inference
// copy Model::use_weights made of it (`--precision`), v then null: fp32 in panels (p,
// kernels::panel_index), bf16 (h), or int8 (q) with one scale per output column (s).
struct WeightView {
  const float* v = nullptr;
  const float* p = nullptr;
  const uint16_t* h = nullptr;
  const int8_t* q = nullptr;
  const float* s = nullptr;
  bool bound() const { return v || p || h || q; }
};

// y[N,out] (+)= x[N,in] @ w[:, col .. col+out) + b through the ops front, on whichever form w
// has. Strides as in ops::linear_forward. An inference copy is in panels: columns [col, col +
// out) must be a part that Model::use_weights laid out on its own (the whole matrix, or the
// query layer's Q or K|V).
void linear(float* y, const float* x, const WeightView& w, const float* b, int64_t N, int64_t in,
            int64_t out, bool accumulate = false, kernels::Strides ld = {}, int64_t col = 0);

struct FfnWeights {
  WeightView w_in;  // [d,f]
  const float* b_in = nullptr;  // [f]
  WeightView w_out;  // [f,d]
  const float* b_out = nullptr;  // [d]
  bool bound() const { return w_in.bound(); }  // an expert in a store may be unbound
};
struct FfnGrads {
  float *w_in, *b_in, *w_out, *b_out;
};

// y[N,d] += FFN(x); saves pre[N,f] (before FastGelu) and act[N,f] (after). On the inference
// copies of the weights when w has them.
void ffn_forward(float* y, float* pre, float* act, const float* x, const FfnWeights& w, int64_t N,
                 int64_t d, int64_t f);

// Accumulates dx[N,d] and the weight gradients. act is overwritten: once W_out's gradient has
// read it, its buffer holds dL/dact and then dL/dpre (no scratch of its own).
void ffn_backward(float* dx, const FfnGrads& g, const float* dy, const float* x, const float* pre,
                  float* act, const FfnWeights& w, int64_t N, int64_t d, int64_t f);

}  // namespace sigma
