// The learned gate's per-row maths (ops::gate_*; kernels/ops.h states each op, model/gate.h
// the gate): softmax and top-k over a row's group, the combine of the experts' outputs and
// its backward. Host planning (capacity, the gathered layout) stays in model/gate.cpp; these
// touch the tensors. Rows run in parallel above kParallelFloats; no result depends on it.
#pragma once
#include <cstdint>

namespace sigma::cpu {

void gate_softmax_topk(float* probs, int32_t* choice, float* gate, const float* z,
                       const int32_t* width, const int32_t* base, int k, int64_t N, int64_t Kmax);
void gate_combine(float* y, const float* yg, const float* gate, const int32_t* pos, int64_t N,
                  int64_t d);
void gate_expert_dy(float* gdy, float* dgate, const float* dy, const float* yg, const float* gate,
                    const int32_t* pos, int64_t N, int64_t d);
void gate_backward_dz(float* dx, float* dz, const float* gdx, const float* dgate,
                      const float* probs, const int32_t* choice, const int32_t* pos,
                      const int32_t* width, const int32_t* base, const float* aux, int k,
                      int64_t N, int64_t d, int64_t Kmax);

// sum of x[i]^2 in double (ops::sum_sq: fixed chunks, the same bits for any thread count).
double sum_sq(const float* x, int64_t n);
// dst[i] = to_bf16(x[i]) (ops::convert_bf16).
void convert_bf16(uint16_t* dst, const float* x, int64_t n);
// w[in, out] (rows ld apart) in bf16 column panels (ops::convert_bf16_panels).
void convert_bf16_panels(uint16_t* dst, const float* w, int64_t in, int64_t out, int64_t ld);
// The same as fp32 (ops::convert_f32_panels).
void convert_f32_panels(float* dst, const float* w, int64_t in, int64_t out, int64_t ld);

}  // namespace sigma::cpu
