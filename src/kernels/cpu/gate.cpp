#include "kernels/cpu/gate.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/bf16.h"
#include "kernels/cpu/parallel.h"
#include "kernels/types.h"

namespace sigma::cpu {

namespace {

// Calls fn(r, slot, j) for each kept (row, choice), j its row in the gathered buffers; rows in
// parallel (each call touches only its own row's outputs).
template <class Fn>
void for_each_kept(const int32_t* pos, int64_t N, int64_t d, Fn&& fn) {
  parallel_for(N, N * d > kParallelFloats, [&](int64_t r) {
    for (int slot = 0; slot < 2; ++slot)
      if (const int32_t j = pos[r * 2 + slot]; j >= 0) fn(r, slot, int64_t(j));
  });
}

}  // namespace

void gate_softmax_topk(float* probs, int32_t* choice, float* gate, const float* z,
                       const int32_t* width, const int32_t* base, int k, int64_t N,
                       int64_t Kmax) {
  parallel_for(N, N * Kmax * kExpMacs > kParallelMacs, [&](int64_t r) {
    const int K = width[r];
    const float* zr = z + r * Kmax;
    float* pr = probs + r * Kmax;
    const float mx = *std::max_element(zr, zr + K);
    float sum = 0;
    for (int e = 0; e < K; ++e) sum += pr[e] = std::exp(zr[e] - mx);
    for (int e = 0; e < K; ++e) pr[e] /= sum;
    std::fill(pr + K, pr + Kmax, 0.0f);
    int e1 = 0;  // top-k, ties: the lower index
    for (int e = 1; e < K; ++e)
      if (pr[e] > pr[e1]) e1 = e;
    choice[r * 2] = base[r] + e1;
    choice[r * 2 + 1] = -1;
    gate[r * 2 + 1] = 0.0f;
    if (k == 1 || K == 1) {
      gate[r * 2] = k == 1 ? pr[e1] : 1.0f;
      return;
    }
    int e2 = e1 == 0 ? 1 : 0;
    for (int e = 0; e < K; ++e)
      if (e != e1 && pr[e] > pr[e2]) e2 = e;
    const float s = pr[e1] + pr[e2];
    choice[r * 2 + 1] = base[r] + e2;
    gate[r * 2] = pr[e1] / s;
    gate[r * 2 + 1] = pr[e2] / s;
  });
}

void gate_combine(float* y, const float* yg, const float* gate, const int32_t* pos, int64_t N,
                  int64_t d) {
  for_each_kept(pos, N, d, [&](int64_t r, int slot, int64_t j) {
    const float gv = gate[r * 2 + slot];
    for (int64_t c = 0; c < d; ++c) y[r * d + c] += gv * yg[j * d + c];
  });
}

void gate_expert_dy(float* gdy, float* dgate, const float* dy, const float* yg, const float* gate,
                    const int32_t* pos, int64_t N, int64_t d) {
  std::fill(dgate, dgate + N * 2, 0.0f);
  for_each_kept(pos, N, d, [&](int64_t r, int slot, int64_t j) {
    const float gv = gate[r * 2 + slot];
    float acc = 0;
    for (int64_t c = 0; c < d; ++c) {
      gdy[j * d + c] = gv * dy[r * d + c];
      acc += dy[r * d + c] * yg[j * d + c];
    }
    dgate[r * 2 + slot] = acc;
  });
}

void gate_backward_dz(float* dx, float* dz, const float* gdx, const float* dgate,
                      const float* probs, const int32_t* choice, const int32_t* pos,
                      const int32_t* width, const int32_t* base, const float* aux, int k,
                      int64_t N, int64_t d, int64_t Kmax) {
  for_each_kept(pos, N, d, [&](int64_t r, int, int64_t j) {
    for (int64_t c = 0; c < d; ++c) dx[r * d + c] += gdx[j * d + c];
  });
  // d(loss)/dp: the combine weights, plus the load-balancing term; then through the softmax.
  parallel_for(N, N * Kmax * 8 > kParallelMacs, [&](int64_t r) {
    const int o = base[r], K = width[r];
    const float* pr = probs + r * Kmax;
    float* dp = dz + r * Kmax;  // dp first, turned into dz in place below
    std::fill(dp, dp + Kmax, 0.0f);
    const int e1 = choice[r * 2] - o, e2 = choice[r * 2 + 1];
    if (k == 1) {
      if (K > 1) dp[e1] += dgate[r * 2];
    } else if (e2 >= 0) {
      const int b = e2 - o;
      const float s = pr[e1] + pr[b], s2 = s * s;
      const float d1 = dgate[r * 2], d2 = dgate[r * 2 + 1];
      dp[e1] += pr[b] / s2 * (d1 - d2);
      dp[b] += pr[e1] / s2 * (d2 - d1);
    }
    if (aux)
      for (int e = 0; e < K; ++e) dp[e] += aux[o + e];
    float dot = 0;
    for (int e = 0; e < K; ++e) dot += pr[e] * dp[e];
    for (int e = 0; e < K; ++e) dp[e] = pr[e] * (dp[e] - dot);
  });
}

namespace {
constexpr int64_t kChunk = int64_t(1) << 14;

double chunk_sq(const float* x, int64_t n) {
  constexpr int kLanes = 16;
  double lane[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int k = 0; k < kLanes; ++k) lane[k] += double(x[j + k]) * x[j + k];
  for (; j < n; ++j) lane[0] += double(x[j]) * x[j];
  double s = 0;
  for (double v : lane) s += v;
  return s;
}
}  // namespace

double sum_sq(const float* x, int64_t n) {
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  if (chunks <= 1) return chunk_sq(x, n);
  std::vector<double> part(size_t(chunks), 0.0);
  parallel_for(chunks, !omp_in_parallel(), [&](int64_t c) {
    part[size_t(c)] = chunk_sq(x + c * kChunk, std::min(kChunk, n - c * kChunk));
  });
  double s = 0;
  for (double v : part) s += v;
  return s;
}

void convert_bf16(uint16_t* dst, const float* x, int64_t n) {
  parallel_for(n, n > (1 << 16), [&](int64_t i) { dst[i] = sigma::to_bf16(x[i]); });
}

namespace {
template <class T, class Convert>
void to_panels(T* dst, const float* w, int64_t in, int64_t out, int64_t ld, Convert convert) {
  const int64_t panels = (out + kernels::kPanelColumns - 1) / kernels::kPanelColumns;
  parallel_for(panels, in * out > (1 << 16), [&](int64_t p) {
    const int64_t c0 = p * kernels::kPanelColumns, width = std::min(kernels::kPanelColumns, out - c0);
    T* d = dst + c0 * in;  // the panel's rows, `width` weights each
    for (int64_t i = 0; i < in; ++i)
      for (int64_t j = 0; j < width; ++j) d[i * width + j] = convert(w[i * ld + c0 + j]);
  });
}
}  // namespace

void convert_bf16_panels(uint16_t* dst, const float* w, int64_t in, int64_t out, int64_t ld) {
  to_panels(dst, w, in, out, ld, [](float v) { return sigma::to_bf16(v); });
}
void convert_f32_panels(float* dst, const float* w, int64_t in, int64_t out, int64_t ld) {
  to_panels(dst, w, in, out, ld, [](float v) { return v; });
}

}  // namespace sigma::cpu
