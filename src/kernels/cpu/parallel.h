// When a loop is worth an OpenMP team: the one place for the cut. Starting a region wakes the
// team's other threads and its end waits for them; under OMP_WAIT_POLICY=passive (sigma's
// default) each of those is a futex wake-up, tens of microseconds on a busy machine, more than
// a small loop costs. Batch-1 decoding runs dozens of kernels a token on one row each
// (docs/benchmarks.md, issue 12), so those run on the calling thread, through parallel_for,
// with no OpenMP region at all. No kernel's results depend on the thread count, so the cut
// changes no bit.
#pragma once
#include <cstdint>

namespace sigma::cpu {

// Elements a memory-bound loop reads or writes (copies, LayerNorm, softmax): a megabyte.
constexpr int64_t kParallelFloats = int64_t(1) << 18;
// Multiply-adds, or exponentials counted as 16 each, of a compute-bound loop.
constexpr int64_t kParallelMacs = int64_t(1) << 20;
constexpr int64_t kExpMacs = 16;

// fn(i) for each i in [0, n): on an OpenMP team in static chunks when `worth` (the cuts above),
// else on the calling thread without entering a region. A region whose `if` clause is false
// still has libgomp build and free a team of one: ~0.45 us a call on Zen 3, and a bf16 KV
// cache's append alone converted each head's keys and values in 128 such calls a token (issue
// 40: 6 % of an int8 token's calling thread).
template <class Fn>
void parallel_for(int64_t n, bool worth, Fn&& fn) {
  if (!worth) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) fn(i);
}

}  // namespace sigma::cpu
