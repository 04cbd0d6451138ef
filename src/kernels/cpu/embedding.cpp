#include "kernels/cpu/embedding.h"

#include "kernels/cpu/parallel.h"

namespace sigma::cpu {

void embedding_forward(float* out, const int32_t* rows, const float* table, const float* pos,
                       int64_t B, int64_t T, int64_t d) {
  parallel_for(B * T, B * T * d > kParallelFloats, [&](int64_t i) {
    float* o = out + i * d;
    const float* p = pos ? pos + (i % T) * d : nullptr;
    if (rows[i] < 0) {  // a row another rank holds
      for (int64_t c = 0; c < d; ++c) o[c] = p ? p[c] : 0.0f;
      return;
    }
    const float* e = table + static_cast<int64_t>(rows[i]) * d;
    if (p)
      for (int64_t c = 0; c < d; ++c) o[c] = e[c] + p[c];
    else
      for (int64_t c = 0; c < d; ++c) o[c] = e[c];
  });
}

void embedding_backward(float* dtable, float* dpos, const float* dout, const int32_t* rows,
                        int64_t B, int64_t T, int64_t d) {
  // Columns split across threads, tokens in order within each: deterministic and race-free.
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t b = 0; b < B; ++b) {
        const float* g = dout + (b * T + t) * d;
        float* p = dpos + t * d;
        for (int64_t c = 0; c < d; ++c) p[c] += g[c];
      }
  }
  constexpr int64_t kChunk = 64;
  const int64_t chunks = (d + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static)
  for (int64_t ch = 0; ch < chunks; ++ch) {
    const int64_t c0 = ch * kChunk, c1 = c0 + kChunk < d ? c0 + kChunk : d;
    for (int64_t i = 0; i < B * T; ++i) {
      if (rows[i] < 0) continue;
      const float* g = dout + i * d;
      float* e = dtable + static_cast<int64_t>(rows[i]) * d;
      for (int64_t c = c0; c < c1; ++c) e[c] += g[c];
    }
  }
}

}  // namespace sigma::cpu
