#include "kernels/cpu/int8.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/bf16.h"
#include "kernels/cpu/parallel.h"
#include "kernels/types.h"

namespace sigma::cpu {

using kernels::i8_index;

namespace {

// w / s to the nearest integer, ties to even (as nearbyint in the default rounding mode), in
// [-127, 127]; 0 where s is 0 (a channel of zeros, or one holding a non-finite weight). Adding
// and taking away 1.5 * 2^23 leaves x rounded to an integer for |x| < 2^22 (|w / s| <= 127 here,
// s = max |w| / 127 rounding by at most half an ulp). Plain arithmetic and a division by 1 where
// s is 0, so that the loops vectorise (CMakeLists.txt builds this file without trapping math).
inline int8_t quantize_weight(float w, float s) {
  const float r = (w / (s > 0 ? s : 1.0f) + 0x1.8p23f) - 0x1.8p23f;
  return s > 0 ? int8_t(std::clamp(r, -127.0f, 127.0f)) : int8_t(0);
}

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
    q[at(i)] = quantize_weight(w[i * step], s);
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
      int32_t nonfinite[kernels::kPanelColumns] = {};  // (a matrix has fewer than 2^31 rows)
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t j = 0; j < width; ++j) {  // selects, no branch: it vectorises
          const float a = std::fabs(w[i * ld + c0 + j]);
          const bool finite = a <= std::numeric_limits<float>::max();
          nonfinite[j] += !finite;
          amax[j] = finite && a > amax[j] ? a : amax[j];
        }
      for (int64_t j = 0; j < width; ++j) {
        bad += nonfinite[j];
        scale[c0 + j] = nonfinite[j] ? 0.0f : amax[j] / 127.0f;
        sc[j] = scale[c0 + j];
      }
      int8_t* panel = q + kernels::i8_elements(rows, c0);  // pair rows of 2 width bytes
      for (int64_t i = 0; i < rows; i += 2) {  // an odd last row is paired with zeros
        const float* even = w + i * ld + c0;
        const float* odd = i + 1 < rows ? even + ld : nullptr;
        int8_t* pair = panel + (i / 2) * 2 * width;
        int8_t q0[kernels::kPanelColumns], q1[kernels::kPanelColumns] = {};
        for (int64_t j = 0; j < width; ++j) q0[j] = quantize_weight(even[j], sc[j]);
        if (odd)
          for (int64_t j = 0; j < width; ++j) q1[j] = quantize_weight(odd[j], sc[j]);
        for (int64_t j = 0; j < width; ++j) {
          pair[2 * j] = q0[j];
          pair[2 * j + 1] = q1[j];
        }
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
