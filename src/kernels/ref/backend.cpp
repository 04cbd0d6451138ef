// Registers the reference formulas (ref/linear.h, ref/layers.h, ref/attention.h), evaluated
// in double, as the "ref" backend of the ops front, with its exact ops (data movement) and its
// fp32 Adam.
#include <cmath>
#include <cstring>

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

}  // namespace

extern const ops::Backend kBackend;
const ops::Backend kBackend = {
    .name = "ref",
    .device = Device::Host,
    .alloc = &host_alloc,
    .free = &host_free,
    .gemm = &gemm<double>,
    .linear_forward = &linear_forward<double>,
    .linear_backward = &linear_backward<double>,
    .gemm_bf16 = &gemm_bf16<double>,
    .linear_forward_bf16 = &linear_forward_bf16<double>,
    .linear_backward_bf16 = &linear_backward_bf16<double>,
    .column_sum_accumulate = &column_sum_accumulate<double>,
    .linear_forward_w16 = &linear_forward_w16<double>,
    .gemm_nt_w16 = &gemm_nt_w16<double>,
    .layernorm_forward = &layernorm_forward<double>,
    .layernorm_backward = &layernorm_backward<double>,
    .attention_forward = &attention_forward<double>,
    .attention_backward = &attention_backward<double>,
    .flash_attention_forward = &flash_attention_forward<double>,
    .flash_attention_backward = &flash_attention_backward<double>,
    .flash_attention_forward_bf16 = &flash_attention_forward_bf16<double>,
    .flash_attention_backward_bf16 = &flash_attention_backward_bf16<double>,
    .fast_gelu_forward = &fast_gelu_forward<double>,
    .fast_gelu_backward = &fast_gelu_backward<double>,
    .softmax_xent = &softmax_xent<double>,
    .embedding_forward = &embedding_forward<double>,
    .embedding_backward = &embedding_backward<double>,
    .adam_step = &adam_step,
    .bf16_mirror_add = nullptr,  // converts every bf16 input where it reads it
    .bf16_mirror_clear = nullptr,
    .copy = &copy,
    .fill = &fill,
    .add_into = &add_into,
    .gather_rows = &gather_rows,
    .scatter_rows = &scatter_rows,
};

}  // namespace sigma::ref
