// The one GEMM wrapper: every matrix product in Sigma goes through here (oneDNN's sgemm).
// Row-major: C[M,N] = alpha * op(A)[M,K] * op(B)[K,N] + beta * C, op = transpose when t* is set.
// Inside an OpenMP parallel region oneDNN runs single-threaded, so callers may parallelise
// over independent products (attention heads) themselves.
#pragma once
#include <cstdint>

#include "kernels/types.h"

namespace sigma::cpu {

using kernels::Strides;

void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
          const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C,
          int64_t ldc);

// One small product: oneDNN generates its sgemm code for this CPU on a process's first product
// (~25-30 ms on Zen 3), once for every thread (ops::warm_up_in_background).
void warm_up_gemm();

// y[N,out] (+)= x[N,in] @ w[in,out] + b   (b may be null; accumulate adds to y instead of
// overwriting it). Row strides (Strides, kernels/types.h) default to the logical widths; a
// column slice of a wider weight (the query layer's K/V part of QKV) passes its own ldw/ldy.
void linear_forward(float* y, const float* x, const float* w, const float* b, int64_t N,
                    int64_t in, int64_t out, bool accumulate = false, Strides ld = {});

// linear_forward with w[in, out] in column panels (kernels::panel_index; no row stride), read
// in place by oneDNN's matmul (matmul.h: a row's bits are not promised to be sgemm's).
void linear_forward_panels(float* y, const float* x, const float* w, const float* b, int64_t N,
                           int64_t in, int64_t out, bool accumulate = false, Strides ld = {});

// Gradients of linear_forward, all accumulated (+=): dx (may be null), dw, db (may be null).
// dx has x's stride, dw has w's, dy has y's.
void linear_backward(float* dx, float* dw, float* db, const float* dy, const float* x,
                     const float* w, int64_t N, int64_t in, int64_t out, Strides ld = {});

// The bf16 variants (kernels/ops.h): both GEMM inputs rounded to bf16, fp32 accumulation, on
// oneDNN's bf16 matmul (kernels/cpu/matmul.h). An operand inside a registered bf16 mirror
// (the model's weights during a training step) is read from its copy; any other is converted
// into per-thread scratch per call (linear_backward_bf16 converts dy once for both products).
void gemm_bf16(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
               const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C,
               int64_t ldc);
void linear_forward_bf16(float* y, const float* x, const float* w, const float* b, int64_t N,
                         int64_t in, int64_t out, bool accumulate = false, Strides ld = {});
void linear_backward_bf16(float* dx, float* dw, float* db, const float* dy, const float* x,
                          const float* w, int64_t N, int64_t in, int64_t out, Strides ld = {});

// C[M,N] = beta * C with row stride ldc (C = 0 when beta is 0): a product with K = 0, which
// oneDNN skips.
void scale_c(int64_t M, int64_t N, float beta, float* C, int64_t ldc);

// dst[rows, cols] (contiguous) = bf16 of src[rows, cols] with row stride ld.
void to_bf16(uint16_t* dst, const float* src, int64_t rows, int64_t cols, int64_t ld);

// db[C] += column sums of dy[N,C] with row stride ld (0 = C); each thread owns columns.
void column_sum_accumulate(float* db, const float* dy, int64_t N, int64_t C, int64_t ld = 0);

}  // namespace sigma::cpu
