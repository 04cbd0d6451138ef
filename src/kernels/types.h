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

// LayerNorm's epsilon (inside the square root), the same for every backend.
constexpr float kLayerNormEps = 1e-5f;

}  // namespace kernels

}  // namespace sigma
