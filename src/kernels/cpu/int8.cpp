#include "kernels/cpu/int8.h"

#include <algorithm>
#include <cmath>

#include "core/bf16.h"
#include "kernels/cpu/parallel.h"
#include "kernels/types.h"

namespace sigma::cpu {

using kernels::i8_index;

namespace {

// One channel: n weights at stride `step`, written to q at index at(i).
template <class At>
int64_t quantize_channel(int8_t* q, At at, float* scale, const float* w, int64_t n, int64_t step) {
  float amax = 0;
  int64_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float a = std::fabs(w[i * step]);
    if (!std::isfinite(a)) ++bad;
    else amax = std::max(amax, a);
  }
  const float s = bad ? 0.0f : amax / 127.0f;
  *scale = s;
  for (int64_t i = 0; i < n; ++i)  // |w / s| <= 127 since s = amax / 127 rounds at most 1/2 ulp
    q[at(i)] = s > 0 ? int8_t(std::clamp(std::nearbyint(w[i * step] / s), -127.0f, 127.0f)) : 0;
  return bad;
}

}  // namespace

int64_t quantize_i8(int8_t* q, float* scale, const float* w, int64_t rows, int64_t cols,
                    int64_t ld, bool per_row) {
  int64_t bad = 0;
  if (per_row) {
#pragma omp parallel for schedule(static) reduction(+ : bad) if (rows * cols > kParallelFloats)
    for (int64_t r = 0; r < rows; ++r)
      bad += quantize_channel(q, [&](int64_t i) { return r * cols + i; }, scale + r, w + r * ld, cols, 1);
  } else {
    // Panel by panel, row by row (a column at a time read each weight a row apart), the
    // channel's definition unchanged.
    const int64_t panels = (cols + kernels::kPanelColumns - 1) / kernels::kPanelColumns;
#pragma omp parallel for schedule(static) reduction(+ : bad) if (rows * cols > kParallelFloats)
    for (int64_t p = 0; p < panels; ++p) {
      const int64_t c0 = p * kernels::kPanelColumns, width = std::min(kernels::kPanelColumns, cols - c0);
      float amax[kernels::kPanelColumns] = {}, sc[kernels::kPanelColumns];
      int64_t nonfinite[kernels::kPanelColumns] = {};
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t j = 0; j < width; ++j) {
          const float a = std::fabs(w[i * ld + c0 + j]);
          if (!std::isfinite(a)) ++nonfinite[j];
          else amax[j] = std::max(amax[j], a);
        }
      for (int64_t j = 0; j < width; ++j) {
        bad += nonfinite[j];
        scale[c0 + j] = nonfinite[j] ? 0.0f : amax[j] / 127.0f;
        sc[j] = scale[c0 + j];
      }
      int8_t* panel = q + kernels::i8_elements(rows, c0);  // pair rows of 2 width bytes
      for (int64_t i = 0; i < rows + rows % 2; ++i)
        for (int64_t j = 0; j < width; ++j) {
          const float s = sc[j];
          panel[(i / 2) * 2 * width + 2 * j + (i & 1)] =
              i < rows && s > 0 ? int8_t(std::clamp(std::nearbyint(w[i * ld + c0 + j] / s), -127.0f, 127.0f)) : 0;
        }
    }
  }
  return bad;
}

void embedding_forward_w16(float* out, const int32_t* rows, const uint16_t* table,
                           const float* pos, int64_t B, int64_t T, int64_t d) {
  for (int64_t i = 0; i < B * T; ++i) {
    const uint16_t* e = table + int64_t(rows[i]) * d;
    const float* p = pos + (i % T) * d;
    float* o = out + i * d;
    for (int64_t c = 0; c < d; ++c) o[c] = from_bf16(e[c]) + p[c];
  }
}

void embedding_forward_i8(float* out, const int32_t* rows, const int8_t* q, const float* scale,
                          const float* pos, int64_t B, int64_t T, int64_t d) {
  for (int64_t i = 0; i < B * T; ++i) {
    const int8_t* e = q + int64_t(rows[i]) * d;
    const float s = scale[rows[i]];
    const float* p = pos + (i % T) * d;
    float* o = out + i * d;
    for (int64_t c = 0; c < d; ++c) o[c] = s * float(e[c]) + p[c];
  }
}

}  // namespace sigma::cpu
