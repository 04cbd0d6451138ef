// Argument types of the ops front (kernels/ops.h), shared by every backend (kernels/cpu/,
// kernels/ref/), so that a call site changes only its namespace when it moves between them.
// Plain structs of pointers and sizes: no framework types reach a kernel (STYLE rule 1).
#pragma once
#include <cmath>
#include <cstdint>

namespace sigma {

namespace kernels {

// Row strides of linear_forward/backward's operands; 0 = contiguous (in, out, out). A column
// slice of a wider weight (the query layer's K/V part of QKV) passes its own ldw/ldy.
struct Strides {
  int64_t x = 0, w = 0, y = 0;
};

// Causal attention of Tq query rows over Tk key rows (Tq <= Tk), H heads of width hd, in B
// sequences. Query row i sits at absolute position Tk - Tq + i and attends keys 0..Tk-Tq+i, so
// training passes Tq == Tk (row i attends 0..i) and a KV-cache decoder passes the new rows
// against the whole cache (Tq = 1: the last position attends everything). Five explicit
// arguments (no aggregate), so that a call written for the old {B, T, H, hd} fails to compile.
struct AttnShape {
  int64_t B, Tq, Tk, H, hd;
  constexpr AttnShape(int64_t B_, int64_t Tq_, int64_t Tk_, int64_t H_, int64_t hd_)
      : B(B_), Tq(Tq_), Tk(Tk_), H(H_), hd(hd_) {}
};

struct AttnOperand {  // a read-only [B, rows, H*hd] view: row stride ld, batch stride bs
  const float* p;
  int64_t ld, bs;
};

struct AttnGrad {  // a gradient [B, rows, H*hd] view (accumulated)
  float* p;
  int64_t ld, bs;
};

// The precision of the front's GEMMs (ops::use_precision): Bf16 rounds both GEMM inputs to
// bf16 (nearest even) and accumulates in fp32; everything else stays fp32 either way.
enum class Precision : uint8_t { Fp32, Bf16 };

// LayerNorm's epsilon (inside the square root), the same for every backend.
constexpr float kLayerNormEps = 1e-5f;

}  // namespace kernels

// One Adam(W) update (ops::adam_step). Per element i, with g = g_in[i] * grad_scale:
//   m = beta1 * m + (1 - beta1) * g
//   v = beta2 * v + (1 - beta2) * g * g
//   w = w - (lr * weight_decay * w + (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps))
// with the bias corrections bc1 = 1 - beta1^step, bc2 = 1 - beta2^step (step 1-based, counted
// per parameter, or per row for lazy rows).
struct AdamStepArgs {
  float lr = 1e-3f;
  float beta1 = 0.9f, beta2 = 0.95f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;  // decoupled: w -= lr * weight_decay * w
  float grad_scale = 1.0f;    // gradients are multiplied by this first (global-norm clipping)
  int64_t step = 1;           // 1-based count of updates of this parameter, this one included
};

// bc1 = 1 - beta1^step, bc2 = 1 - beta2^step, in fp32 (powf of a float exponent). Every
// backend derives its constants through this one function.
struct AdamBiasCorrections {
  float bc1, bc2;
};
inline AdamBiasCorrections adam_bias_corrections(float beta1, float beta2, int64_t step) {
  return {1.0f - std::pow(beta1, float(step)), 1.0f - std::pow(beta2, float(step))};
}

}  // namespace sigma
