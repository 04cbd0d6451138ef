#include "kernels/cpu/layernorm.h"

#include <algorithm>
#include <cmath>

#include "kernels/cpu/matmul.h"
#include "kernels/cpu/parallel.h"

namespace sigma::cpu {

// The row sums run in SIMD lanes (omp simd reductions: partial sums per lane, then combined).
// Summed in order, each was one dependent chain of C scalar additions, ~2 % of a bf16 training
// step at d = 512; the lane order is fixed at compile time, so results stay deterministic.
namespace {
float row_sum(const float* x, int64_t C) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t j = 0; j < C; ++j) s += x[j];
  return s;
}
float row_sq_dev(const float* x, float m, int64_t C) {
  float v = 0.0f;
#pragma omp simd reduction(+ : v)
  for (int64_t j = 0; j < C; ++j) v += (x[j] - m) * (x[j] - m);
  return v;
}
}  // namespace

// In bf16 training the outputs are registered in the bf16 mirror (Model::block_forward, head):
// each row's copy is written while the row is in L1, instead of by the next product re-reading
// the output from memory.
void layernorm_forward(float* out, float* mean, float* rstd, const float* x, const float* w,
                       const float* b, int64_t N, int64_t C) {
  uint16_t* copy = bf16_mirror_claim(out, N * C);
  auto row = [&](int64_t i) {
    const float* xi = x + i * C;
    const float m = row_sum(xi, C) / C;
    const float r = 1.0f / std::sqrt(row_sq_dev(xi, m, C) / C + kLayerNormEps);
    float* oi = out + i * C;
    for (int64_t j = 0; j < C; ++j) oi[j] = (xi[j] - m) * r * w[j] + b[j];
    if (copy) row_to_bf16(copy + i * C, oi, C);
    mean[i] = m;
    rstd[i] = r;
  };
  parallel_for(N, N * C > kParallelFloats, row);
}

// With n = (x-mean)*rstd and g = dout*w:  dx = rstd * (g - mean(g) - n * mean(g*n)).
void layernorm_backward(float* dx, float* dw, float* db, const float* dout, const float* x,
                        const float* mean, const float* rstd, const float* w, int64_t N,
                        int64_t C) {
  parallel_for(N, N * C > kParallelFloats, [&](int64_t i) {
    const float* xi = x + i * C;
    const float* di = dout + i * C;
    const float m = mean[i], r = rstd[i];
    float sum_g = 0.0f, sum_gn = 0.0f;
#pragma omp simd reduction(+ : sum_g, sum_gn)
    for (int64_t j = 0; j < C; ++j) {
      const float g = di[j] * w[j];
      sum_g += g;
      sum_gn += g * (xi[j] - m) * r;
    }
    const float mg = sum_g / C, mgn = sum_gn / C;
    float* dxi = dx + i * C;
    for (int64_t j = 0; j < C; ++j) {
      const float n = (xi[j] - m) * r;
      dxi[j] += r * (di[j] * w[j] - mg - n * mgn);
    }
  });
  // Parameter gradients: each thread owns a column range, rows summed in order.
  constexpr int64_t kChunk = 64;
  const int64_t chunks = (C + kChunk - 1) / kChunk;
  parallel_for(chunks, N * C > kParallelFloats, [&](int64_t c) {
    const int64_t j0 = c * kChunk, j1 = std::min(C, j0 + kChunk);
    float aw[kChunk] = {}, ab[kChunk] = {};
    for (int64_t i = 0; i < N; ++i) {
      const float* xi = x + i * C;
      const float* di = dout + i * C;
      const float m = mean[i], r = rstd[i];
      for (int64_t j = j0; j < j1; ++j) {
        aw[j - j0] += di[j] * (xi[j] - m) * r;
        ab[j - j0] += di[j];
      }
    }
    for (int64_t j = j0; j < j1; ++j) {
      dw[j] += aw[j - j0];
      db[j] += ab[j - j0];
    }
  });
}

}  // namespace sigma::cpu
