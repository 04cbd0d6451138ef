// ref: gemm, linear_forward/backward, column_sum_accumulate (see ref/io.h for the rules).
#pragma once
#include "kernels/ref/io.h"

namespace sigma::ref {

// C[M,N] = alpha * op(A) op(B) + beta * C; beta = 0 ignores C (BLAS semantics).
template <class T>
void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
          int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      T s = 0;
      for (int64_t k = 0; k < K; ++k)
        s += T(ta ? A[k * lda + i] : A[i * lda + k]) * T(tb ? B[j * ldb + k] : B[k * ldb + j]);
      T c = T(alpha) * s;
      if (beta != 0.0f) c += T(beta) * T(C[i * ldc + j]);
      store<T>(C + i * ldc + j, c);
    }
}

// y = (accumulate ? y : 0) + b + x w.
template <class T>
void linear_forward(float* y, const float* x, const float* w, const float* b, int64_t N,
                    int64_t in, int64_t out, bool accumulate, Strides ld) {
  const int64_t ldx = ld.x ? ld.x : in, ldw = ld.w ? ld.w : out, ldy = ld.y ? ld.y : out;
  for (int64_t i = 0; i < N; ++i)
    for (int64_t j = 0; j < out; ++j) {
      T s = accumulate ? T(y[i * ldy + j]) : T(0);
      if (b) s += T(b[j]);
      for (int64_t k = 0; k < in; ++k) s += T(x[i * ldx + k]) * T(w[k * ldw + j]);
      store<T>(y + i * ldy + j, s);
    }
}

// db[j] += sum_i dy[i,j].
template <class T>
void column_sum_accumulate(float* db, const float* dy, int64_t N, int64_t C, int64_t ld) {
  if (ld == 0) ld = C;
  for (int64_t j = 0; j < C; ++j) {
    T s = T(db[j]);
    for (int64_t i = 0; i < N; ++i) s += T(dy[i * ld + j]);
    store<T>(db + j, s);
  }
}

// dx[i,k] += sum_j dy[i,j] w[k,j];  dw[k,j] += sum_i x[i,k] dy[i,j];  db[j] += sum_i dy[i,j].
template <class T>
void linear_backward(float* dx, float* dw, float* db, const float* dy, const float* x,
                     const float* w, int64_t N, int64_t in, int64_t out, Strides ld) {
  const int64_t ldx = ld.x ? ld.x : in, ldw = ld.w ? ld.w : out, ldy = ld.y ? ld.y : out;
  if (dx)
    for (int64_t i = 0; i < N; ++i)
      for (int64_t k = 0; k < in; ++k) {
        T s = T(dx[i * ldx + k]);
        for (int64_t j = 0; j < out; ++j) s += T(dy[i * ldy + j]) * T(w[k * ldw + j]);
        store<T>(dx + i * ldx + k, s);
      }
  for (int64_t k = 0; k < in; ++k)
    for (int64_t j = 0; j < out; ++j) {
      T s = T(dw[k * ldw + j]);
      for (int64_t i = 0; i < N; ++i) s += T(x[i * ldx + k]) * T(dy[i * ldy + j]);
      store<T>(dw + k * ldw + j, s);
    }
  if (db) column_sum_accumulate<T>(db, dy, N, out, ldy);
}

}  // namespace sigma::ref
