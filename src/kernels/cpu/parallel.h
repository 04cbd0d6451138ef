// When a loop is worth an OpenMP team: the one place for the cut. Starting a region wakes the
// team's other threads and its end waits for them; under OMP_WAIT_POLICY=passive (sigma's
// default) each of those is a futex wake-up, tens of microseconds on a busy machine, more than
// a small loop costs. Batch-1 decoding runs dozens of kernels a token on one row each
// (docs/benchmarks.md, issue 12), so those run on the calling thread. No kernel's results
// depend on the thread count, so the cut changes no bit.
#pragma once
#include <cstdint>

namespace sigma::cpu {

// Elements a memory-bound loop reads or writes (copies, LayerNorm, softmax): a megabyte.
constexpr int64_t kParallelFloats = int64_t(1) << 18;
// Multiply-adds, or exponentials counted as 16 each, of a compute-bound loop.
constexpr int64_t kParallelMacs = int64_t(1) << 20;
constexpr int64_t kExpMacs = 16;

}  // namespace sigma::cpu
