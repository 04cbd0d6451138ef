// ref: gemm, linear_forward/backward, column_sum_accumulate, and their bf16 forms (see
// ref/io.h for the rules).
#pragma once
#include <vector>

#include "core/bf16.h"
#include "core/error.h"
#include "kernels/ref/io.h"

namespace sigma::ref {

// A GEMM input as the formula reads it: exact, or first rounded to bf16 (the *_bf16 ops); a
// bf16 weight copy (the *_w16 ops) widened, which is exact.
template <bool Bf16>
inline float in(float x) {
  if constexpr (Bf16) return round_bf16(x);
  return x;
}
template <bool Bf16>
inline float in(uint16_t w16) {
  return from_bf16(w16);
}

// C[M,N] = alpha * op(A) op(B) + beta * C; beta = 0 ignores C (BLAS semantics).
template <class T, bool Bf16 = false, class BT = float>
void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
          int64_t lda, const BT* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      T s = 0;
      for (int64_t k = 0; k < K; ++k)
        s += T(in<Bf16>(ta ? A[k * lda + i] : A[i * lda + k])) *
             T(in<Bf16>(tb ? B[j * ldb + k] : B[k * ldb + j]));
      T c = T(alpha) * s;
      if (beta != 0.0f) c += T(beta) * T(C[i * ldc + j]);
      store<T>(C + i * ldc + j, c);
    }
}

// y = (accumulate ? y : 0) + b + x w.
template <class T, bool Bf16 = false, class W = float>
void linear_forward(float* y, const float* x, const W* w, const float* b, int64_t N,
                    int64_t in, int64_t out, bool accumulate, Strides ld) {
  const int64_t ldx = ld.x ? ld.x : in, ldw = ld.w ? ld.w : out, ldy = ld.y ? ld.y : out;
  for (int64_t i = 0; i < N; ++i)
    for (int64_t j = 0; j < out; ++j) {
      T s = accumulate ? T(y[i * ldy + j]) : T(0);
      if (b) s += T(b[j]);
      for (int64_t k = 0; k < in; ++k)
        s += T(ref::in<Bf16>(x[i * ldx + k])) * T(ref::in<Bf16>(w[k * ldw + j]));
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
template <class T, bool Bf16 = false>
void linear_backward(float* dx, float* dw, float* db, const float* dy, const float* x,
                     const float* w, int64_t N, int64_t in, int64_t out, Strides ld) {
  const int64_t ldx = ld.x ? ld.x : in, ldw = ld.w ? ld.w : out, ldy = ld.y ? ld.y : out;
  if (dx)
    for (int64_t i = 0; i < N; ++i)
      for (int64_t k = 0; k < in; ++k) {
        T s = T(dx[i * ldx + k]);
        for (int64_t j = 0; j < out; ++j)
          s += T(ref::in<Bf16>(dy[i * ldy + j])) * T(ref::in<Bf16>(w[k * ldw + j]));
        store<T>(dx + i * ldx + k, s);
      }
  for (int64_t k = 0; k < in; ++k)
    for (int64_t j = 0; j < out; ++j) {
      T s = T(dw[k * ldw + j]);
      for (int64_t i = 0; i < N; ++i)
        s += T(ref::in<Bf16>(x[i * ldx + k])) * T(ref::in<Bf16>(dy[i * ldy + j]));
      store<T>(dw + k * ldw + j, s);
    }
  if (db) column_sum_accumulate<T>(db, dy, N, out, ldy);
}

// The bf16 ops: the same formulas over inputs rounded to bf16 (bias and accumulated values
// stay exact fp32).
template <class T>
void gemm_bf16(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
               int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  gemm<T, true>(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}
template <class T>
void linear_forward_bf16(float* y, const float* x, const float* w, const float* b, int64_t N,
                         int64_t in, int64_t out, bool accumulate, Strides ld) {
  linear_forward<T, true>(y, x, w, b, N, in, out, accumulate, ld);
}
template <class T>
void linear_backward_bf16(float* dx, float* dw, float* db, const float* dy, const float* x,
                          const float* w, int64_t N, int64_t in, int64_t out, Strides ld) {
  linear_backward<T, true>(dx, dw, db, dy, x, w, N, in, out, ld);
}

// The ops on fp32 and bf16 weights in panels: the fp32 formulas over the weights put back in
// rows (and widened).
template <class T, class W>
void linear_forward_panels(const char* op, float* y, const float* x, const W* w, const float* b,
                           int64_t N, int64_t in, int64_t out, bool accumulate, Strides ld) {
  SIGMA_CHECK(ld.w == 0 || ld.w == out, "{}: weights in panels have no row stride (got {} for {} columns)",
              op, ld.w, out);
  std::vector<W> rows(size_t(in * out));  // w out of its panels (kernels::panel_index)
  for (int64_t k = 0; k < in; ++k)
    for (int64_t j = 0; j < out; ++j) rows[size_t(k * out + j)] = w[kernels::panel_index(k, j, in, out)];
  linear_forward<T>(y, x, rows.data(), b, N, in, out, accumulate, {ld.x, 0, ld.y});
}
template <class T>
void linear_forward_f32_panels(float* y, const float* x, const float* w, const float* b, int64_t N,
                               int64_t in, int64_t out, bool accumulate, Strides ld) {
  linear_forward_panels<T>("linear_forward_f32_panels", y, x, w, b, N, in, out, accumulate, ld);
}
template <class T>
void linear_forward_w16(float* y, const float* x, const uint16_t* w16, const float* b, int64_t N,
                        int64_t in, int64_t out, bool accumulate, Strides ld) {
  linear_forward_panels<T>("linear_forward_w16", y, x, w16, b, N, in, out, accumulate, ld);
}
// y[N,out] = x[N,in] w16[out,in]^T (the head).
template <class T>
void gemm_nt_w16(float* y, const float* x, const uint16_t* w16, int64_t N, int64_t in,
                 int64_t out, int64_t ldx, int64_t ldw, int64_t ldy) {
  gemm<T>(false, true, N, out, in, 1.0f, x, ldx, w16, ldw, 0.0f, y, ldy);
}

// The ops on int8 weights: scale[j] * (the exact sum of x q), then the bias (kernels/ops.h; the
// cpu kernels apply the scale once, to the finished sum, and so does this formula), each row of
// x first rounded to 16-bit fixed point (kernels::round_row16): x[k] reads as step * xq[k].
template <class T>
void linear_forward_i8(float* y, const float* x, const int8_t* q, const float* scale,
                       const float* b, int64_t N, int64_t in, int64_t out, bool accumulate,
                       Strides ld) {
  SIGMA_CHECK(ld.w == 0 || ld.w == out,
              "linear_forward_i8: int8 weights in panels have no row stride (got {} for {} columns)", ld.w, out);
  const int64_t ldx = ld.x ? ld.x : in, ldy = ld.y ? ld.y : out;
  std::vector<int16_t> xq(static_cast<size_t>(in));
  for (int64_t i = 0; i < N; ++i) {
    const float step = kernels::round_row16(xq.data(), x + i * ldx, in);
    for (int64_t j = 0; j < out; ++j) {
      T dot = 0;
      for (int64_t k = 0; k < in; ++k)
        dot += T(step) * T(float(xq[size_t(k)])) * T(float(q[kernels::i8_index(k, j, in, out)]));
      T s = accumulate ? T(y[i * ldy + j]) : T(0);
      if (b) s += T(b[j]);
      s += T(scale[j]) * dot;
      store<T>(y + i * ldy + j, s);
    }
  }
}
// y[N,out] = x[N,in] (scale * q)[out,in]^T, a scale per row of q (the head).
template <class T>
void gemm_nt_i8(float* y, const float* x, const int8_t* q, const float* scale, int64_t N,
                int64_t in, int64_t out, int64_t ldx, int64_t ldw, int64_t ldy) {
  std::vector<int16_t> xq(static_cast<size_t>(in));
  for (int64_t i = 0; i < N; ++i) {
    const float step = kernels::round_row16(xq.data(), x + i * ldx, in);
    for (int64_t j = 0; j < out; ++j) {
      T dot = 0;
      for (int64_t k = 0; k < in; ++k)
        dot += T(step) * T(float(xq[size_t(k)])) * T(float(q[j * ldw + k]));
      store<T>(y + i * ldy + j, T(scale[j]) * dot);
    }
  }
}

}  // namespace sigma::ref
