#include "kernels/cpu/gemm.h"

#include <oneapi/dnnl/dnnl.h>
#include <omp.h>

#include <algorithm>
#include <vector>

#include "core/error.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/parallel.h"
#include "kernels/ops.h"

namespace sigma::cpu {

// C = beta * C for an empty sum (K = 0): BLAS semantics, which oneDNN skips.
void scale_c(int64_t M, int64_t N, float beta, float* C, int64_t ldc) {
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) C[i * ldc + j] = beta == 0.0f ? 0.0f : beta * C[i * ldc + j];
}

namespace {
// A row's bits must not depend on how many rows share its product where losses are compared
// across batches: eval (alone or among other domains, at any --batch; docs/reliability.md) and
// scoring, both inside ops::BatchInvariant. oneDNN's sgemm does not promise that: it picks
// kernels by the shape (measured on Zen 5, oneDNN 2.6: below 16 rows; on Zen 3, AVX2: a tail of
// 1-3 rows of 6 takes another kernel, e.g. rows past the 16th of a 56-row call at K = 48), and
// with several threads it splits the sum over K between them by the shape (Zen 3, 2 threads:
// N = 48, K >= 192; N = 1100, K = 512, M = 480). So inside BatchInvariant a product runs as
// tiles of exactly kTileRows rows (the last padded with zero rows) by kColBlock columns, each
// one single-threaded sgemm call, the tiles spread over the threads by us: every row is then
// computed by the same call shape, and within a 48-row call a row's bits do not depend on its
// place (measured on Zen 3 over K 16-2048, N 8-8192; test_ops' GemmRowInvariance checks it on
// the machine it runs on). 48-row calls run at ~0.85-0.9x of one large call on Zen 3 (16-row
// ones at 0.3-0.6x), so training keeps oneDNN's own kernels and threads, where fewer than
// kInvariantRows rows are padded to 16, which keeps a small expert's product on the many-row
// kernels. Decode keeps its own kernels (FewRowKernels).
constexpr int64_t kInvariantRows = 16;
constexpr int64_t kTileRows = 48, kColBlock = 512;

void sgemm_checked(bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
                   int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  const dnnl_status_t st =
      dnnl_sgemm('N', tb ? 'T' : 'N', M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  SIGMA_CHECK(st == dnnl_success, "oneDNN sgemm failed (status {}) for M={} N={} K={}",
              static_cast<int>(st), M, N, K);
}

// Rows [0, M) of the product computed as P > M rows, the others zero.
void gemm_padded(bool tb, int64_t M, int64_t P, int64_t N, int64_t K, float alpha,
                 const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C,
                 int64_t ldc) {
  thread_local std::vector<float> a, c;
  a.assign(size_t(P * K), 0.0f);
  c.assign(size_t(P * N), 0.0f);
  for (int64_t i = 0; i < M; ++i) {
    std::copy_n(A + i * lda, K, a.data() + i * K);
    if (beta != 0.0f) std::copy_n(C + i * ldc, N, c.data() + i * N);
  }
  sgemm_checked(tb, P, N, K, alpha, a.data(), K, B, ldb, beta, c.data(), N);
  for (int64_t i = 0; i < M; ++i) std::copy_n(c.data() + i * N, N, C + i * ldc);
}

void gemm_row_tiles(bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
                    int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  const int64_t row_tiles = (M + kTileRows - 1) / kTileRows;
  const int64_t col_tiles = (N + kColBlock - 1) / kColBlock, tiles = row_tiles * col_tiles;
  auto tile = [&](int64_t t) {
    const int64_t r0 = t / col_tiles * kTileRows, rows = std::min(kTileRows, M - r0);
    const int64_t c0 = t % col_tiles * kColBlock, cols = std::min(kColBlock, N - c0);
    const float* b = B + (tb ? c0 * ldb : c0);  // op(B)'s columns c0..: rows of B when tb
    if (rows < kTileRows)
      gemm_padded(tb, rows, kTileRows, cols, K, alpha, A + r0 * lda, lda, b, ldb, beta, C + r0 * ldc + c0, ldc);
    else
      sgemm_checked(tb, rows, cols, K, alpha, A + r0 * lda, lda, b, ldb, beta, C + r0 * ldc + c0, ldc);
  };
  if (omp_in_parallel()) {  // oneDNN runs on the calling thread inside an active team
    for (int64_t t = 0; t < tiles; ++t) tile(t);
    return;
  }
  if (tiles == 1 || M * N * K < kParallelMacs) {  // one thread, and oneDNN must not split it
    const int threads = omp_get_max_threads();
    omp_set_num_threads(1);
    for (int64_t t = 0; t < tiles; ++t) tile(t);
    omp_set_num_threads(threads);
    return;
  }
#pragma omp parallel for schedule(dynamic)
  for (int64_t t = 0; t < tiles; ++t) tile(t);
}
}  // namespace

void warm_up_gemm() {
  float a[64] = {}, b[64] = {}, c[64];
  sgemm_checked(false, 8, 8, 8, 1.0f, a, 8, b, 8, 0.0f, c, 8);
}

void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
          int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  if (M == 0 || N == 0) return;
  if (K == 0) return scale_c(M, N, beta, C, ldc);  // oneDNN leaves C untouched for K = 0
  if (!ta && ops::BatchInvariant::on())
    return gemm_row_tiles(tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  if (!ta && M < kInvariantRows && !ops::FewRowKernels::on())
    return gemm_padded(tb, M, kInvariantRows, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  dnnl_status_t st = dnnl_sgemm(ta ? 'T' : 'N', tb ? 'T' : 'N', M, N, K, alpha, A, lda, B, ldb,
                                beta, C, ldc);
  SIGMA_CHECK(st == dnnl_success, "oneDNN sgemm failed (status {}) for M={} N={} K={}",
              static_cast<int>(st), M, N, K);
}

namespace {
using GemmFn = void (*)(bool, bool, int64_t, int64_t, int64_t, float, const float*, int64_t,
                        const float*, int64_t, float, float*, int64_t);

// Per-thread conversion scratch of the bf16 ops: one buffer per operand role.
struct Bf16Scratch {
  std::vector<uint16_t> a, b, dy;
};
thread_local Bf16Scratch t_scratch;
}  // namespace

void to_bf16(uint16_t* dst, const float* src, int64_t rows, int64_t cols, int64_t ld) {
  to_bf16(dst, cols, src, ld, rows, cols);
}

void gemm_bf16(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
               int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  if (M == 0 || N == 0) return;
  if (K == 0) return scale_c(M, N, beta, C, ldc);
  Bf16Scratch& s = t_scratch;
  const Bf16View a = bf16_operand(A, ta ? K : M, ta ? M : K, lda, s.a);
  const Bf16View b = bf16_operand(B, tb ? N : K, tb ? K : N, ldb, s.b);
  matmul_bf16(ta, tb, M, N, K, alpha, a, b, beta, C, ldc);
}

namespace {
void linear_forward_with(GemmFn gemm, float* y, const float* x, const float* w, const float* b,
                         int64_t N, int64_t in, int64_t out, bool accumulate, Strides ld) {
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

void linear_backward_with(GemmFn gemm, float* dx, float* dw, float* db, const float* dy,
                          const float* x, const float* w, int64_t N, int64_t in, int64_t out,
                          Strides ld) {
  const int64_t ldx = ld.x ? ld.x : in, ldw = ld.w ? ld.w : out, ldy = ld.y ? ld.y : out;
  if (dx) gemm(false, true, N, in, out, 1.0f, dy, ldy, w, ldw, 1.0f, dx, ldx);
  gemm(true, false, in, out, N, 1.0f, x, ldx, dy, ldy, 1.0f, dw, ldw);
  if (db) column_sum_accumulate(db, dy, N, out, ldy);
}
}  // namespace

void linear_forward(float* y, const float* x, const float* w, const float* b, int64_t N,
                    int64_t in, int64_t out, bool accumulate, Strides ld) {
  linear_forward_with(&gemm, y, x, w, b, N, in, out, accumulate, ld);
}
void linear_backward(float* dx, float* dw, float* db, const float* dy, const float* x,
                     const float* w, int64_t N, int64_t in, int64_t out, Strides ld) {
  linear_backward_with(&gemm, dx, dw, db, dy, x, w, N, in, out, ld);
}
void linear_forward_panels(float* y, const float* x, const float* w, const float* b, int64_t N,
                           int64_t in, int64_t out, bool accumulate, Strides ld) {
  auto on_panels = [](bool, bool, int64_t M, int64_t N, int64_t K, float, const float* A, int64_t lda,
                      const float* B, int64_t, float beta, float* C, int64_t ldc) {
    matmul_f32_panels(M, N, K, A, lda, B, beta, C, ldc);
  };
  linear_forward_with(on_panels, y, x, w, b, N, in, out, accumulate, {ld.x, out, ld.y});
}
// The bias rides in the product (no separate pass over y): y = x w + b (+ y).
void linear_forward_bf16(float* y, const float* x, const float* w, const float* b, int64_t N,
                         int64_t in, int64_t out, bool accumulate, Strides ld) {
  const int64_t ldx = ld.x ? ld.x : in, ldw = ld.w ? ld.w : out, ldy = ld.y ? ld.y : out;
  if (in == 0 || N == 0) return linear_forward_with(&gemm_bf16, y, x, w, b, N, in, out, accumulate, ld);
  Bf16Scratch& s = t_scratch;
  matmul_bf16(false, false, N, out, in, 1.0f, bf16_operand(x, N, in, ldx, s.a),
              bf16_operand(w, in, out, ldw, s.b), accumulate ? 1.0f : 0.0f, y, ldy, b);
}
// dy is read by both products: converted once, with db's column sums in the same pass.
void linear_backward_bf16(float* dx, float* dw, float* db, const float* dy, const float* x,
                          const float* w, int64_t N, int64_t in, int64_t out, Strides ld) {
  const int64_t ldx = ld.x ? ld.x : in, ldw = ld.w ? ld.w : out, ldy = ld.y ? ld.y : out;
  if (N == 0) return;
  Bf16Scratch& s = t_scratch;
  const Bf16View dyb = db ? bf16_operand_column_sums(dy, N, out, ldy, s.dy, db)
                          : bf16_operand(dy, N, out, ldy, s.dy);
  if (dx)
    matmul_bf16(false, true, N, in, out, 1.0f, dyb, bf16_operand(w, in, out, ldw, s.b), 1.0f, dx,
                ldx);
  matmul_bf16(true, false, in, out, N, 1.0f, bf16_operand(x, N, in, ldx, s.a), dyb, 1.0f, dw, ldw);
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
