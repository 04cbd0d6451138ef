#include "model/ffn.h"

#include <algorithm>

#include "kernels/ops.h"

namespace sigma {

void linear(float* y, const float* x, const WeightView& w, const float* b, int64_t N, int64_t in,
            int64_t out, bool accumulate, kernels::Strides ld, int64_t col) {
  // A copy is in panels (kernels/types.h): a part used on its own is a matrix of its own.
  if (w.q)
    ops::linear_forward_i8(y, x, w.q + ops::i8_elements(in, col), w.s + col, b, N, in, out, accumulate,
                           {ld.x, 0, ld.y});
  else if (w.h)
    ops::linear_forward_w16(y, x, w.h + col * in, b, N, in, out, accumulate, {ld.x, 0, ld.y});
  else if (w.p)
    ops::linear_forward_f32_panels(y, x, w.p + col * in, b, N, in, out, accumulate, {ld.x, 0, ld.y});
  else
    ops::linear_forward(y, x, w.v + col, b, N, in, out, accumulate, ld);
}

void ffn_forward(float* y, float* pre, float* act, const float* x, const FfnWeights& w, int64_t N,
                 int64_t d, int64_t f) {
  linear(pre, x, w.w_in, w.b_in, N, d, f);
  ops::fast_gelu_forward(act, pre, N * f);
  linear(y, act, w.w_out, w.b_out, N, f, d, /*accumulate=*/true);
}

// The products and their order are those of dL/dact and dL/dpre in buffers of their own (the
// same bits); reusing act's buffer spares 2*N*f floats of scratch, the largest buffer of an
// FFN's backward after pre and act themselves (issue 38: a ZeRO-3 rank's activations).
void ffn_backward(float* dx, const FfnGrads& g, const float* dy, const float* x, const float* pre,
                  float* act, const FfnWeights& w, int64_t N, int64_t d, int64_t f) {
  ops::linear_backward(nullptr, g.w_out, g.b_out, dy, act, w.w_out.v, N, f, d);  // last read of act
  ops::bf16_mirror_drop(act);  // in bf16 its copy (Model::mirror) would be read for d_pre below
  float* d_act = act;
  ops::gemm(false, true, N, f, d, 1.0f, dy, d, w.w_out.v, d, 0.0f, d_act, f);  // dy W_out^T
  float* d_pre = d_act;
  ops::fast_gelu_backward(d_pre, d_act, pre, N * f);  // in place
  ops::linear_backward(dx, g.w_in, g.b_in, d_pre, x, w.w_in.v, N, d, f);
}

}  // namespace sigma
