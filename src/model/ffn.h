// The position-wise FFN, d -> f (FastGelu) -> d, as free functions over raw pointers so the
// dense block and each RRE expert run the same code on their own rows.
#pragma once
#include <cstdint>

namespace sigma {

struct FfnWeights {
  const float *w_in, *b_in, *w_out, *b_out;  // [d,f], [f], [f,d], [d]
};
struct FfnGrads {
  float *w_in, *b_in, *w_out, *b_out;
};

// y[N,d] += FFN(x); saves pre[N,f] (before FastGelu) and act[N,f] (after).
void ffn_forward(float* y, float* pre, float* act, const float* x, const FfnWeights& w, int64_t N,
                 int64_t d, int64_t f);

// Accumulates dx[N,d] and the weight gradients. scratch holds 2*N*f floats (overwritten).
void ffn_backward(float* dx, const FfnGrads& g, float* scratch, const float* dy, const float* x,
                  const float* pre, const float* act, const FfnWeights& w, int64_t N, int64_t d,
                  int64_t f);

}  // namespace sigma
