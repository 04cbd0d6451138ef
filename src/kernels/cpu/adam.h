// The cpu backend's Adam(W) kernel (ops::adam_step; the formula is in kernels/types.h): one
// fused, vectorised, multi-threaded pass over raw pointers. It is the only Adam kernel: AdamW
// (src/optim/adamw.cpp) reaches it through the ops front, and the ECSS expert store
// (src/ecss/expert_store.cpp), whose records are host memory whatever the compute backend,
// calls it here directly (with bf16 gradients too). So in-model, ECSS and vanilla-offload runs
// update a parameter with the same fp32 operations, bit for bit.
//
// Every path evaluates the formula as the same sequence of IEEE fp32 operations (explicit FMAs,
// correctly rounded sqrt and division; adam_elem in adam.cpp is that sequence), so the AVX-512
// path, the scalar path, any thread count and the ref backend's adam_step give bit-identical
// results.
//
// Memory traffic: w, m, v read and written, g read: 28 bytes per parameter with fp32 gradients,
// 26 with bf16. The kernel is bandwidth-bound on any machine with AVX-512.
#pragma once
#include <cstdint>

#include "kernels/types.h"

namespace sigma::cpu {

enum class AdamPath : uint8_t {
  Auto,    // the fastest path this CPU supports (checked once, at run time)
  Scalar,  // portable C++ (the compiler may still vectorise it)
  Avx512,  // AVX-512F intrinsics; throws sigma::Error where the CPU lacks AVX-512F
};
bool adam_path_available(AdamPath p);
AdamPath adam_best_path();  // Avx512 or Scalar
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

}  // namespace sigma::cpu
