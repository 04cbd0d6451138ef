// OpenMP threads that spin at barriers collapse when the cores are shared: measured 1,800
// against 51,000 tokens/s for the main job on 2 busy cores; and a benchmark whose OpenMP region
// (a bandwidth probe) leaves a spinning worker beside the decode kernels' spin team halves what
// their second thread adds (bench_gemv, 2 threads, Zen 3: fp32 / bf16 / int8 18-21 / 21-23 /
// 13-16 GB/s against 37.8 / 28.7 / 26.5 with a passive policy). libgomp reads its environment
// before main, so this sets a passive wait policy (unless the user chose one) and re-executes
// the program; it returns only where that fails, to run as we are.
#pragma once
#include <cstdlib>

#include <unistd.h>

namespace sigma {

inline void ensure_passive_omp_wait(char** argv) {
  if (std::getenv("OMP_WAIT_POLICY")) return;
  setenv("OMP_WAIT_POLICY", "passive", 1);
  execv("/proc/self/exe", argv);
}

}  // namespace sigma
