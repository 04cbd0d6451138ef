// Causal multi-head attention over B sequences of T positions, H heads of width hd.
// q, k, v are row-major with row strides ld_* and batch strides bs_* (a batch stride of 0 lets
// the query layer share one query table across the batch). Head h reads columns [h*hd, h*hd+hd).
#pragma once
#include <cstdint>

#include "kernels/cpu/contract.h"

namespace sigma::cpu {

struct AttnShape {
  int64_t B, T, H, hd;
};

struct AttnOperand {  // a read-only [B, T, H*hd] view
  const float* p;
  int64_t ld, bs;
};

struct AttnGrad {  // a gradient [B, T, H*hd] view (accumulated)
  float* p;
  int64_t ld, bs;
};

// out[B,T,H*hd] (row stride H*hd) = softmax(scale * q k^T, causal) v; saves probs[B,H,T,T]
// (zero above the diagonal). Softmax runs in fp32.
void attention_forward(float* out, float* probs, AttnOperand q, AttnOperand k, AttnOperand v,
                       AttnShape s, float scale);

// Accumulates dq, dk, dv. `out` is the forward output (used for the softmax backward).
// dq must not alias across batches (bs != 0).
void attention_backward(AttnGrad dq, AttnGrad dk, AttnGrad dv, const float* dout,
                        const float* out, const float* probs, AttnOperand q, AttnOperand k,
                        AttnOperand v, AttnShape s, float scale);

}  // namespace sigma::cpu
