// The Adam(W) update kernel of ECSS (DESIGN §3, issue 5): one fused, vectorised, multi-threaded
// pass over raw pointers, free of framework types, so the expert store, the trainer and the
// benchmarks share it and it can be tested on its own.
//
// Per element i, with g = g_in[i] * grad_scale (the same formula as adamw_update in adamw.h):
//   m = beta1 * m + (1 - beta1) * g
//   v = beta2 * v + (1 - beta2) * g * g
//   w = w - (lr * weight_decay * w + (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps))
// with the bias corrections bc1 = 1 - beta1^step, bc2 = 1 - beta2^step (step 1-based, counted
// per parameter). Every path evaluates this as the same sequence of IEEE fp32 operations
// (explicit FMAs, correctly rounded sqrt and division), so the AVX-512 path, the scalar path and
// any thread count give bit-identical results; adamw_update may differ in the last bits where
// the compiler contracts its products differently.
//
// Memory traffic: w, m, v read and written, g read: 28 bytes per parameter with fp32 gradients,
// 26 with bf16. The kernel is bandwidth-bound on any machine with AVX-512.
#pragma once
#include <cstdint>

namespace sigma {

struct AdamStepArgs {
  float lr = 1e-3f;
  float beta1 = 0.9f, beta2 = 0.95f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;  // decoupled: w -= lr * weight_decay * w
  float grad_scale = 1.0f;    // gradients are multiplied by this first (global-norm clipping)
  int64_t step = 1;           // 1-based count of updates of this parameter, this one included
};

// bc1 = 1 - beta1^step, bc2 = 1 - beta2^step in fp32, computed exactly as AdamW::step does.
struct AdamBiasCorrections {
  float bc1, bc2;
};
AdamBiasCorrections adam_bias_corrections(float beta1, float beta2, int64_t step);

enum class AdamPath : uint8_t {
  Auto,    // the fastest path this CPU supports (checked once, at run time)
  Scalar,  // portable C++ (the compiler may still vectorise it)
  Avx512,  // AVX-512F intrinsics; throws sigma::Error where the CPU lacks AVX-512F
};
bool adam_path_available(AdamPath p);
AdamPath adam_best_path();   // Avx512 or Scalar
const char* adam_path_name(AdamPath p);

// One update of n parameters in place. w, m, v: [n] fp32; g: [n] fp32 or bf16 (raw bits, the
// upper half of an fp32). Above a size threshold the work is split over the OpenMP threads in
// static chunks of whole 64-byte lines; inside an OpenMP parallel region it runs on the calling
// thread only. Throws sigma::Error for step < 1 or an unavailable path.
void adam_step(float* w, float* m, float* v, const float* g, int64_t n, const AdamStepArgs& a,
               AdamPath path = AdamPath::Auto);
void adam_step(float* w, float* m, float* v, const uint16_t* g_bf16, int64_t n,
               const AdamStepArgs& a, AdamPath path = AdamPath::Auto);

// Sizes below this run on one thread (an OpenMP fork costs more than it saves).
inline constexpr int64_t kAdamParallelMin = int64_t(1) << 15;

}  // namespace sigma
