// Registers the reference formulas (ref/linear.h, ref/layers.h, ref/attention.h), evaluated
// in double, as the "ref" backend of the ops front, with its exact ops (data movement) and its
// fp32 Adam.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/bf16.h"

#include "core/error.h"
#include "core/tensor.h"
#include "kernels/ops.h"
#include "kernels/ref/attention.h"
#include "kernels/ref/layers.h"
#include "kernels/ref/linear.h"

namespace sigma::ref {

namespace {

// Adam in fp32, deliberately not in double: the formula of kernels/types.h as one fixed
// sequence of IEEE fp32 operations (explicit FMAs, correctly rounded sqrt and division), the
// sequence the cpu kernel (kernels/cpu/adam.cpp) performs on every path. So the two backends
// agree bit for bit and a run's parameters do not depend on which backend updated them;
// tests/test_adam_kernel.cpp checks this sequence against the formula in double.
void adam_step(float* w, float* m, float* v, const float* g, int64_t n, const AdamStepArgs& a) {
  SIGMA_CHECK(a.step >= 1, "adam_step: step count {} must be >= 1 (it counts this update)", a.step);
  const AdamBiasCorrections bc = adam_bias_corrections(a.beta1, a.beta2, a.step);
  const float omb1 = 1.0f - a.beta1, omb2 = 1.0f - a.beta2, step_size = a.lr / bc.bc1;
  const float inv_sqrt_bc2 = 1.0f / std::sqrt(bc.bc2), decay = a.lr * a.weight_decay;
  for (int64_t i = 0; i < n; ++i) {
    const float gi = g[i] * a.grad_scale;
    const float mn = std::fma(a.beta1, m[i], omb1 * gi);
    const float vn = std::fma(a.beta2, v[i], (omb2 * gi) * gi);
    const float den = std::fma(std::sqrt(vn), inv_sqrt_bc2, a.eps);
    const float upd = (step_size * mn) / den;
    w[i] = w[i] - std::fma(decay, w[i], upd);
    m[i] = mn;
    v[i] = vn;
  }
}

void copy(float* dst, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = src[i];
}
void fill(float* dst, float value, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = value;
}
void add_into(float* dst, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = dst[i] + src[i];
}
void gather_rows(float* dst, const float* src, const int32_t* order, int64_t N, int64_t d) {
  for (int64_t j = 0; j < N; ++j)
    for (int64_t c = 0; c < d; ++c) dst[j * d + c] = src[int64_t(order[j]) * d + c];
}
void scatter_rows(float* dst, const float* src, const int32_t* order, int64_t N, int64_t d,
                  bool accumulate) {
  for (int64_t j = 0; j < N; ++j)
    for (int64_t c = 0; c < d; ++c) {
      float& o = dst[int64_t(order[j]) * d + c];
      o = accumulate ? o + src[j * d + c] : src[j * d + c];
    }
}

void copy_bytes(void* dst, const void* src, size_t bytes) {
  auto* d = static_cast<unsigned char*>(dst);
  const auto* s = static_cast<const unsigned char*>(src);
  for (size_t i = 0; i < bytes; ++i) d[i] = s[i];
}

double sum_sq(const float* x, int64_t n) {  // a plain sum in double (not the cpu's chunk order)
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += double(x[i]) * double(x[i]);
  return s;
}
void convert_bf16(uint16_t* dst, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = to_bf16(x[i]);
}
void convert_bf16_panels(uint16_t* dst, const float* w, int64_t in, int64_t out, int64_t ld) {
  for (int64_t i = 0; i < in; ++i)
    for (int64_t j = 0; j < out; ++j) dst[kernels::panel_index(i, j, in, out)] = to_bf16(w[i * ld + j]);
}
void convert_f32_panels(float* dst, const float* w, int64_t in, int64_t out, int64_t ld) {
  for (int64_t i = 0; i < in; ++i)
    for (int64_t j = 0; j < out; ++j) dst[kernels::panel_index(i, j, in, out)] = w[i * ld + j];
}
// The quantisation's definition (kernels/ops.h), channel by channel, in fp32 as specified.
int64_t quantize_i8(int8_t* q, float* scale, const float* w, int64_t rows, int64_t cols,
                    int64_t ld, bool per_row) {
  const int64_t channels = per_row ? rows : cols, n = per_row ? cols : rows;
  int64_t bad = 0;
  for (int64_t c = 0; c < channels; ++c) {
    auto src = [&](int64_t i) { return per_row ? c * ld + i : i * ld + c; };
    auto dst = [&](int64_t i) { return per_row ? c * cols + i : kernels::i8_index(i, c, rows, cols); };
    float amax = 0;
    bool finite = true;
    for (int64_t i = 0; i < n; ++i) {
      if (!std::isfinite(w[src(i)])) ++bad, finite = false;
      else amax = std::max(amax, std::fabs(w[src(i)]));
    }
    scale[c] = finite ? amax / 127.0f : 0.0f;
    for (int64_t i = 0; i < n; ++i) {
      const float r = scale[c] > 0 ? std::nearbyint(w[src(i)] / scale[c]) : 0.0f;
      q[dst(i)] = int8_t(std::clamp(r, -127.0f, 127.0f));
    }
    if (!per_row && rows % 2) q[kernels::i8_index(rows, c, rows, cols)] = 0;  // the odd row's partner
  }
  return bad;
}

// The learned gate in double: the softmax, the top-k on the double probabilities, the weights.
void gate_softmax_topk(float* probs, int32_t* choice, float* gate, const float* z,
                       const int32_t* width, const int32_t* base, int k, int64_t N,
                       int64_t Kmax) {
  std::vector<double> p(static_cast<size_t>(Kmax));
  for (int64_t r = 0; r < N; ++r) {
    const int K = width[r];
    double mx = z[r * Kmax], sum = 0;
    for (int e = 1; e < K; ++e) mx = std::max(mx, double(z[r * Kmax + e]));
    for (int e = 0; e < K; ++e) sum += p[size_t(e)] = std::exp(double(z[r * Kmax + e]) - mx);
    for (int e = 0; e < Kmax; ++e) probs[r * Kmax + e] = e < K ? float(p[size_t(e)] / sum) : 0.0f;
    int e1 = 0;
    for (int e = 1; e < K; ++e)
      if (p[size_t(e)] > p[size_t(e1)]) e1 = e;
    choice[r * 2] = base[r] + e1;
    choice[r * 2 + 1] = -1;
    gate[r * 2 + 1] = 0.0f;
    if (k == 1 || K == 1) {
      gate[r * 2] = k == 1 ? float(p[size_t(e1)] / sum) : 1.0f;
      continue;
    }
    int e2 = e1 == 0 ? 1 : 0;
    for (int e = 0; e < K; ++e)
      if (e != e1 && p[size_t(e)] > p[size_t(e2)]) e2 = e;
    const double s2 = p[size_t(e1)] + p[size_t(e2)];
    choice[r * 2 + 1] = base[r] + e2;
    gate[r * 2] = float(p[size_t(e1)] / s2);
    gate[r * 2 + 1] = float(p[size_t(e2)] / s2);
  }
}
void gate_combine(float* y, const float* yg, const float* gate, const int32_t* pos, int64_t N,
                  int64_t d) {
  for (int64_t r = 0; r < N; ++r)
    for (int64_t c = 0; c < d; ++c) {
      double acc = y[r * d + c];
      for (int s = 0; s < 2; ++s)
        if (pos[r * 2 + s] >= 0) acc += double(gate[r * 2 + s]) * yg[pos[r * 2 + s] * d + c];
      y[r * d + c] = float(acc);
    }
}
void gate_expert_dy(float* gdy, float* dgate, const float* dy, const float* yg, const float* gate,
                    const int32_t* pos, int64_t N, int64_t d) {
  for (int64_t r = 0; r < N; ++r)
    for (int s = 0; s < 2; ++s) {
      const int64_t j = pos[r * 2 + s];
      double acc = 0;
      for (int64_t c = 0; j >= 0 && c < d; ++c) {
        gdy[j * d + c] = float(double(gate[r * 2 + s]) * dy[r * d + c]);
        acc += double(dy[r * d + c]) * yg[j * d + c];
      }
      dgate[r * 2 + s] = float(acc);
    }
}
void gate_backward_dz(float* dx, float* dz, const float* gdx, const float* dgate,
                      const float* probs, const int32_t* choice, const int32_t* pos,
                      const int32_t* width, const int32_t* base, const float* aux, int k,
                      int64_t N, int64_t d, int64_t Kmax) {
  std::vector<double> dp(static_cast<size_t>(Kmax));
  for (int64_t r = 0; r < N; ++r) {
    for (int64_t c = 0; c < d; ++c) {
      double acc = dx[r * d + c];
      for (int s = 0; s < 2; ++s)
        if (pos[r * 2 + s] >= 0) acc += gdx[pos[r * 2 + s] * d + c];
      dx[r * d + c] = float(acc);
    }
    const int o = base[r], K = width[r];
    const float* pr = probs + r * Kmax;
    std::fill(dp.begin(), dp.end(), 0.0);
    const int e1 = choice[r * 2] - o, e2 = choice[r * 2 + 1];
    if (k == 1) {
      if (K > 1) dp[size_t(e1)] += dgate[r * 2];
    } else if (e2 >= 0) {  // d/dp1 of p1/(p1+p2) = p2/s^2, of p2/(p1+p2) = -p2/s^2
      const int b = e2 - o;
      const double s = double(pr[e1]) + pr[b], s2 = s * s;
      dp[size_t(e1)] += pr[b] / s2 * (double(dgate[r * 2]) - dgate[r * 2 + 1]);
      dp[size_t(b)] += pr[e1] / s2 * (double(dgate[r * 2 + 1]) - dgate[r * 2]);
    }
    if (aux)
      for (int e = 0; e < K; ++e) dp[size_t(e)] += aux[o + e];
    double dot = 0;
    for (int e = 0; e < K; ++e) dot += double(pr[e]) * dp[size_t(e)];
    for (int e = 0; e < Kmax; ++e) dz[r * Kmax + e] = e < K ? float(pr[e] * (dp[size_t(e)] - dot)) : 0.0f;
  }
}

}  // namespace

extern const ops::Backend kBackend;
const ops::Backend kBackend = {
    .name = "ref",
    .device = Device::Host,
    .alloc = &host_alloc,
    .free = &host_free,
    .upload = &copy_bytes,
    .download = &copy_bytes,
    .copy_bytes = &copy_bytes,
    .gemm = &gemm<double>,
    .linear_forward = &linear_forward<double>,
    .linear_backward = &linear_backward<double>,
    .gemm_bf16 = &gemm_bf16<double>,
    .linear_forward_bf16 = &linear_forward_bf16<double>,
    .linear_backward_bf16 = &linear_backward_bf16<double>,
    .column_sum_accumulate = &column_sum_accumulate<double>,
    .linear_forward_f32_panels = &linear_forward_f32_panels<double>,
    .linear_forward_w16 = &linear_forward_w16<double>,
    .gemm_nt_w16 = &gemm_nt_w16<double>,
    .linear_forward_i8 = &linear_forward_i8<double>,
    .gemm_nt_i8 = &gemm_nt_i8<double>,
    .layernorm_forward = &layernorm_forward<double>,
    .layernorm_backward = &layernorm_backward<double>,
    .attention_forward = &attention_forward<double>,
    .attention_backward = &attention_backward<double>,
    .flash_attention_forward = &flash_attention_forward<double>,
    .flash_attention_backward = &flash_attention_backward<double>,
    .flash_attention_forward_bf16 = &flash_attention_forward_bf16<double>,
    .flash_attention_backward_bf16 = &flash_attention_backward_bf16<double>,
    .attention_forward_kv16 = &attention_forward_kv16<double>,
    .fast_gelu_forward = &fast_gelu_forward<double>,
    .fast_gelu_backward = &fast_gelu_backward<double>,
    .softmax_xent = &softmax_xent<double>,
    .xent_partial = &xent_partial<double>,
    .xent_combine = &xent_combine<double>,
    .embedding_forward = &embedding_forward<double>,
    .embedding_backward = &embedding_backward<double>,
    .embedding_forward_w16 = &embedding_forward_w16<double>,
    .embedding_forward_i8 = &embedding_forward_i8<double>,
    .adam_step = &adam_step,
    .bf16_mirror_add = nullptr,  // converts every bf16 input where it reads it
    .bf16_mirror_clear = nullptr,
    .bf16_mirror_drop = nullptr,
    .copy = &copy,
    .fill = &fill,
    .add_into = &add_into,
    .gather_rows = &gather_rows,
    .scatter_rows = &scatter_rows,
    .sum_sq = &sum_sq,
    .convert_bf16 = &convert_bf16,
    .convert_bf16_panels = &convert_bf16_panels,
    .convert_f32_panels = &convert_f32_panels,
    .quantize_i8 = &quantize_i8,
    .gate_softmax_topk = &gate_softmax_topk,
    .gate_combine = &gate_combine,
    .gate_expert_dy = &gate_expert_dy,
    .gate_backward_dz = &gate_backward_dz,
};

}  // namespace sigma::ref
