// Products of a few rows against a weight matrix, as batch-1 (and few-slot) decoding runs them:
// memory-bound, so every weight is read once per call, by one of the threads, streaming. Why
// not oneDNN (which the rows past kGemvMaxRows still use, gemm.h): it has no product of fp32
// activations with bf16 weights, and its sgemm does not give a row the same bits for every
// batch size. For fp32 at one row it streams about as fast (docs/benchmarks.md, issue 12).
//
// Weights are fp32, or bf16 or int8 copies made once at load (Model::use_weights). A bf16
// weight is widened to fp32 exactly, and the products and sums are fp32, so only the weights
// round. A linear's inference weights (fp32, bf16 or int8) are in column panels
// (kernels/types.h), the head's in rows. An int8 matrix has one fp32 scale per output channel;
// each row of x is rounded to 16-bit fixed point (xq = x / step, step = max|x| / 32767), the
// sum S = xq . q is exact in integers (16-bit multiply-adds, int32 lanes that cannot overflow,
// int64 totals), and y = scale * (step * S) + b.
//
// Each output element is one fixed sequence of fp32 operations whatever the number of rows and
// threads (FMAs over fixed chunks of k, the chunk sums added in order; int8's sums exact): a
// row's result does not depend on the rows computed with it (serving with up to kGemvMaxRows
// slots is batch-invariant bit for bit).
#pragma once
#include <cstdint>

#include "kernels/types.h"

namespace sigma::cpu {

using kernels::Strides;

constexpr int64_t kGemvMaxRows = 4;

// y[M,out] (+)= x[M,in] @ w[in,out] + b, M <= kGemvMaxRows (b may be null; strides as in
// linear_forward, 0 = contiguous; bf16 w in panels, ld.w 0).
void gemv_nn(float* y, const float* x, const float* w, const float* b, int64_t M, int64_t in,
             int64_t out, bool accumulate, Strides ld);
void gemv_nn(float* y, const float* x, const uint16_t* w, const float* b, int64_t M, int64_t in,
             int64_t out, bool accumulate, Strides ld);
// The same on fp32 weights in panels (kernels::panel_index; ld.w 0): the bits of gemv_nn on the
// same weights in rows.
void gemv_nn_panels(float* y, const float* x, const float* w, const float* b, int64_t M, int64_t in,
                    int64_t out, bool accumulate, Strides ld);
// y[M,out] = x[M,in] @ w[out,in]^T (each output a dot product with a row of w: the tied head).
void gemv_nt(float* y, const float* x, const float* w, int64_t M, int64_t in, int64_t out,
             int64_t ldx, int64_t ldw, int64_t ldy);
void gemv_nt(float* y, const float* x, const uint16_t* w, int64_t M, int64_t in, int64_t out,
             int64_t ldx, int64_t ldw, int64_t ldy);
// The same on int8 weights q with per-output scales: scale[out] (nn: one per column of q[in,out],
// in panels of row pairs, ld.w 0; nt: one per row of q[out,in], plain rows).
void gemv_nn(float* y, const float* x, const int8_t* q, const float* scale, const float* b,
             int64_t M, int64_t in, int64_t out, bool accumulate, Strides ld);
void gemv_nt(float* y, const float* x, const int8_t* q, const float* scale, int64_t M, int64_t in,
             int64_t out, int64_t ldx, int64_t ldw, int64_t ldy);

// The kernels exist for AVX-512 with VNNI (int8's multiply-adds in one instruction; otherwise
// AVX-512's), AVX-512, AVX2 (+FMA) and in portable scalar code, each with the same order of
// operations per element, so the same bits; Best (the default) is the first of kGemvSimdIsas the
// CPU has, else Portable. Tests and benchmarks pick one with gemv_use_isa (not thread-safe: set
// it before the products run); gemv_isa() is the one in use.
enum class GemvIsa { Best, Avx512Vnni, Avx512, Avx2, Portable };
inline constexpr GemvIsa kGemvSimdIsas[] = {GemvIsa::Avx512Vnni, GemvIsa::Avx512, GemvIsa::Avx2};
bool gemv_isa_available(GemvIsa isa);
void gemv_use_isa(GemvIsa isa);
GemvIsa gemv_isa();
const char* gemv_isa_name(GemvIsa isa);

// The cpu backend's gemm and linear_forward: a few rows go to the kernels above, the rest to
// oneDNN (gemm.h).
void gemm_rows(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
               const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C,
               int64_t ldc);
void linear_forward_rows(float* y, const float* x, const float* w, const float* b, int64_t N,
                         int64_t in, int64_t out, bool accumulate, Strides ld);

// The ops with bf16 weight copies (kernels/ops.h): linear_forward with w16[in,out], and the
// head's y[N,out] = x[N,in] @ w16[out,in]^T. More than kGemvMaxRows rows (a prompt), or rows
// outside a decode step, widen the weights a block of about 4 MiB at a time into per-thread
// fp32 scratch and run oneDNN's sgemm on each block: the same values, and never an fp32 copy of
// a large matrix.
void linear_forward_w16(float* y, const float* x, const uint16_t* w16, const float* b, int64_t N,
                        int64_t in, int64_t out, bool accumulate, Strides ld);
void gemm_nt_w16(float* y, const float* x, const uint16_t* w16, int64_t N, int64_t in,
                 int64_t out, int64_t ldx, int64_t ldw, int64_t ldy);
// linear_forward on an fp32 inference copy in panels (ops::linear_forward_f32_panels): a prompt's
// rows run as bf16's do, on panels of the weights put back in rows.
void linear_forward_f32_panels(float* y, const float* x, const float* w, const float* b, int64_t N,
                               int64_t in, int64_t out, bool accumulate, Strides ld);
// The same two on int8 weights (ops::linear_forward_i8, ops::gemm_nt_i8); a prompt's panels hold
// scale * q, and its rows of x are rounded to 16-bit fixed point first, as the GEMVs round them.
void linear_forward_i8(float* y, const float* x, const int8_t* q, const float* scale,
                       const float* b, int64_t N, int64_t in, int64_t out, bool accumulate,
                       Strides ld);
void gemm_nt_i8(float* y, const float* x, const int8_t* q, const float* scale, int64_t N,
                int64_t in, int64_t out, int64_t ldx, int64_t ldw, int64_t ldy);

}  // namespace sigma::cpu
