// Registers today's cpu kernels as the "cpu" backend of the ops front (kernels/ops.h).
#include "core/tensor.h"
#include "kernels/cpu/activation.h"
#include "kernels/cpu/adam.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/embedding.h"
#include "kernels/cpu/gate.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/gemv.h"
#include "kernels/cpu/int8.h"
#include "kernels/cpu/layernorm.h"
#include "kernels/cpu/movement.h"
#include "kernels/cpu/xent.h"
#include "kernels/ops.h"

namespace sigma::cpu {

namespace {
// The front's adam_step has no path argument: the cpu backend takes the fastest path.
void adam_step_auto(float* w, float* m, float* v, const float* g, int64_t n,
                    const AdamStepArgs& a) {
  adam_step(w, m, v, g, n, a, AdamPath::Auto);
}
}  // namespace

extern const ops::Backend kBackend;
const ops::Backend kBackend = {
    .name = "cpu",
    .device = Device::Host,
    .alloc = &host_alloc,
    .free = &host_free,
    .upload = &copy_bytes,
    .download = &copy_bytes,
    .copy_bytes = &copy_bytes,
    .warm_up = &warm_up_gemm,
    .gemm = &gemm_rows,  // a few rows: the GEMV kernels (gemv.h); more: oneDNN
    .linear_forward = &linear_forward_rows,
    .linear_backward = &linear_backward,
    .gemm_bf16 = &gemm_bf16,
    .linear_forward_bf16 = &linear_forward_bf16,
    .linear_backward_bf16 = &linear_backward_bf16,
    .column_sum_accumulate = &column_sum_accumulate,
    .linear_forward_f32_panels = &linear_forward_f32_panels,
    .linear_forward_w16 = &linear_forward_w16,
    .gemm_nt_w16 = &gemm_nt_w16,
    .linear_forward_i8 = &linear_forward_i8,
    .gemm_nt_i8 = &gemm_nt_i8,
    .layernorm_forward = &layernorm_forward,
    .layernorm_backward = &layernorm_backward,
    .attention_forward = &attention_forward,
    .attention_backward = &attention_backward,
    .flash_attention_forward = &flash_attention_forward,
    .flash_attention_backward = &flash_attention_backward,
    .flash_attention_forward_bf16 = &flash_attention_forward_bf16,
    .flash_attention_backward_bf16 = &flash_attention_backward_bf16,
    .attention_forward_kv16 = &attention_forward_kv16,
    .fast_gelu_forward = &fast_gelu_forward,
    .fast_gelu_backward = &fast_gelu_backward,
    .softmax_xent = &softmax_xent,
    .xent_partial = &xent_partial,
    .xent_combine = &xent_combine,
    .embedding_forward = &embedding_forward,
    .embedding_backward = &embedding_backward,
    .embedding_forward_w16 = &embedding_forward_w16,
    .embedding_forward_i8 = &embedding_forward_i8,
    .adam_step = &adam_step_auto,
    .bf16_mirror_add = &bf16_mirror_add,
    .bf16_mirror_clear = &bf16_mirror_clear,
    .bf16_mirror_drop = &bf16_mirror_drop,
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

}  // namespace sigma::cpu
