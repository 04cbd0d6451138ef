#include "optim/grad_norm.h"

#include <omp.h>

#include <algorithm>
#include <vector>

#include "model/names.h"

namespace sigma {

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
#pragma omp parallel for schedule(static) if (!omp_in_parallel())
  for (int64_t c = 0; c < chunks; ++c)
    part[size_t(c)] = chunk_sq(x + c * kChunk, std::min(kChunk, n - c * kChunk));
  double s = 0;
  for (double v : part) s += v;
  return s;
}

double grad_sq(const ParamSet& ps) {
  double total = 0;
  std::vector<const Param*> experts;  // stacked [K, ...]: four per (block, group), in order
  for (const Param& p : ps.all()) {
    if (p.expert && p.grad.shape().size() >= 2) {
      experts.push_back(&p);
      continue;
    }
    total += sum_sq(p.grad.f(), p.grad.numel());
  }
  // Registration order is block, group, leaf: each run of tensors with the same leading K is
  // one (block, group); within it, expert k's leaves in order.
  for (size_t first = 0; first < experts.size();) {
    size_t last = first;
    const std::string group = names::expert_prefix_of(experts[first]->name);
    while (last < experts.size() && names::expert_prefix_of(experts[last]->name) == group)
      ++last;
    const int64_t K = experts[first]->grad.dim(0);
    for (int64_t k = 0; k < K; ++k)
      for (size_t t = first; t < last; ++t) {
        const int64_t per = experts[t]->grad.numel() / K;
        total += sum_sq(experts[t]->grad.f() + k * per, per);
      }
    first = last;
  }
  return total;
}

}  // namespace sigma
