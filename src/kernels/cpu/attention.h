// Causal multi-head attention of Tq query rows over Tk key rows (AttnShape, kernels/types.h:
// query row i sits at position Tk - Tq + i and attends keys 0..Tk-Tq+i; training passes
// Tq == Tk), in B sequences, H heads of width hd. q, k, v are row-major views with row strides
// ld and batch strides bs (a batch stride of 0 lets the query layer share one query table
// across the batch). Head h reads columns [h*hd, h*hd+hd).
#pragma once
#include <cstdint>

#include "kernels/cpu/contract.h"
#include "kernels/types.h"

namespace sigma::cpu {

using kernels::AttnGrad;
using kernels::AttnOperand;
using kernels::AttnOperand16;
using kernels::AttnShape;

// out[B,Tq,H*hd] (row stride H*hd) = softmax(scale * q k^T, causal) v; saves probs[B,H,Tq,Tk]
// (zero beyond each row's last key). Softmax runs in fp32.
void attention_forward(float* out, float* probs, AttnOperand q, AttnOperand k, AttnOperand v,
                       AttnShape s, float scale);

// Accumulates dq, dk, dv. `out` is the forward output (used for the softmax backward).
// Gradient views must not alias across batches (bs != 0 when B > 1).
void attention_backward(AttnGrad dq, AttnGrad dk, AttnGrad dv, const float* dout,
                        const float* out, const float* probs, AttnOperand q, AttnOperand k,
                        AttnOperand v, AttnShape s, float scale);

// The same attention without the [Tq, Tk] probabilities: per 128-row block of queries the
// scores of the keys that block sees (the causal half only) live in per-thread scratch of
// 128 x Tk floats, the forward saves each row's log-sum-exp lse[B,H,Tq] (natural log of
// sum_j exp(scale q_i . k_j)) and the backward recomputes the probabilities from it. A row
// block sees all its keys at once, so its softmax is exact in one pass (no running rescale).
void flash_attention_forward(float* out, float* lse, AttnOperand q, AttnOperand k, AttnOperand v,
                             AttnShape s, float scale);
void flash_attention_backward(AttnGrad dq, AttnGrad dk, AttnGrad dv, const float* dout,
                              const float* out, const float* lse, AttnOperand q, AttnOperand k,
                              AttnOperand v, AttnShape s, float scale);

// flash_attention_forward on bf16 keys and values, widened where read (ops.h: attention_forward_kv16).
void attention_forward_kv16(float* out, float* lse, AttnOperand q, AttnOperand16 k,
                            AttnOperand16 v, AttnShape s, float scale);

// train.precision = bf16: the same blocks and fp32 softmax, with every product on bf16 inputs
// (fp32 accumulation): q, k, v (and dout) rounded once per call, the probabilities (and dS)
// rounded per row after their fp32 computation. The saved lse is the fp32 softmax's.
void flash_attention_forward_bf16(float* out, float* lse, AttnOperand q, AttnOperand k,
                                  AttnOperand v, AttnShape s, float scale);
void flash_attention_backward_bf16(AttnGrad dq, AttnGrad dk, AttnGrad dv, const float* dout,
                                   const float* out, const float* lse, AttnOperand q,
                                   AttnOperand k, AttnOperand v, AttnShape s, float scale);

}  // namespace sigma::cpu
