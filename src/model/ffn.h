// The position-wise FFN, d -> f (FastGelu) -> d, as free functions over raw pointers so the
// dense block and each RRE expert run the same code on their own rows.
#pragma once
#include <cstdint>

namespace sigma {

struct FfnWeights {
  const float *w_in, *b_in, *w_out, *b_out;  // [d,f], [f], [f,d], [d]
  // Inference copies of w_in and w_out (Model::use_weights), or null: bf16, int8 with one
  // scale per output channel (s_in [f], s_out [d]), or fp32 in panels (kernels::panel_index).
  const uint16_t* w_in16 = nullptr;
  const uint16_t* w_out16 = nullptr;
  const int8_t* w_in8 = nullptr;
  const float* s_in = nullptr;
  const int8_t* w_out8 = nullptr;
  const float* s_out = nullptr;
  const float* w_in_panels = nullptr;
  const float* w_out_panels = nullptr;
  bool bound() const { return w_in || w_in16 || w_in8 || w_in_panels; }  // an expert in a store may be unbound
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
