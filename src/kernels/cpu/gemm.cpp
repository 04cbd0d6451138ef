#include "kernels/cpu/gemm.h"

#include <oneapi/dnnl/dnnl.h>

#include <algorithm>

#include "core/error.h"

namespace sigma::cpu {

void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
          int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  if (M == 0 || N == 0) return;
  if (K == 0) {  // oneDNN leaves C untouched for K=0; the math says C = beta*C
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) C[i * ldc + j] = beta == 0.0f ? 0.0f : beta * C[i * ldc + j];
    return;
  }
  dnnl_status_t st = dnnl_sgemm(ta ? 'T' : 'N', tb ? 'T' : 'N', M, N, K, alpha, A, lda, B, ldb,
                                beta, C, ldc);
  SIGMA_CHECK(st == dnnl_success, "oneDNN sgemm failed (status {}) for M={} N={} K={}",
              static_cast<int>(st), M, N, K);
}

void linear_forward(float* y, const float* x, const float* w, const float* b, int64_t N,
                    int64_t in, int64_t out, bool accumulate, Strides ld) {
  const int64_t ldx = ld.x ? ld.x : in, ldw = ld.w ? ld.w : out, ldy = ld.y ? ld.y : out;
  float beta = accumulate ? 1.0f : 0.0f;
  if (b) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < N; ++i) {
      float* row = y + i * ldy;
      if (accumulate)
        for (int64_t j = 0; j < out; ++j) row[j] += b[j];
      else
        for (int64_t j = 0; j < out; ++j) row[j] = b[j];
    }
    beta = 1.0f;
  }
  gemm(false, false, N, out, in, 1.0f, x, ldx, w, ldw, beta, y, ldy);
}

void linear_backward(float* dx, float* dw, float* db, const float* dy, const float* x,
                     const float* w, int64_t N, int64_t in, int64_t out, Strides ld) {
  const int64_t ldx = ld.x ? ld.x : in, ldw = ld.w ? ld.w : out, ldy = ld.y ? ld.y : out;
  if (dx) gemm(false, true, N, in, out, 1.0f, dy, ldy, w, ldw, 1.0f, dx, ldx);
  gemm(true, false, in, out, N, 1.0f, x, ldx, dy, ldy, 1.0f, dw, ldw);
  if (db) column_sum_accumulate(db, dy, N, out, ldy);
}

void column_sum_accumulate(float* db, const float* dy, int64_t N, int64_t C, int64_t ld) {
  if (ld == 0) ld = C;
  constexpr int64_t kChunk = 64;
  const int64_t chunks = (C + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t j0 = c * kChunk, j1 = std::min(C, j0 + kChunk);
    float acc[kChunk] = {};
    for (int64_t i = 0; i < N; ++i) {
      const float* row = dy + i * ld;
      for (int64_t j = j0; j < j1; ++j) acc[j - j0] += row[j];
    }
    for (int64_t j = j0; j < j1; ++j) db[j] += acc[j - j0];
  }
}

}  // namespace sigma::cpu
