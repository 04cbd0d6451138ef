#include "optim/grad_norm.h"

#include <algorithm>
#include <vector>

#include "kernels/cpu/gate.h"
#include "kernels/ops.h"
#include "model/names.h"

namespace sigma {

// The chunked sum of squares is an op (ops::sum_sq): gradients live on the device.
double sum_sq(const float* x, int64_t n) { return ops::sum_sq(x, n); }
double host_sum_sq(const float* x, int64_t n) { return cpu::sum_sq(x, n); }

std::vector<double> grad_sq_parts(const ParamSet& ps, const std::vector<uint8_t>& owned) {
  std::vector<double> parts;
  auto mine = [&](size_t i) { return owned.empty() || owned[i]; };
  std::vector<size_t> experts;  // stacked [K, ...]: four per (block, group), in order
  const auto& all = ps.all();
  for (size_t i = 0; i < all.size(); ++i) {
    const Param& p = all[i];
    if (p.expert && p.grad.shape().size() >= 2) {
      experts.push_back(i);
      continue;
    }
    parts.push_back(mine(i) ? sum_sq(p.grad.dev_f(), p.grad.numel()) : 0.0);
  }
  // Registration order is block, group, leaf: each run of tensors with the same leading K is
  // one (block, group); within it, expert k's leaves in order.
  for (size_t first = 0; first < experts.size();) {
    size_t last = first;
    const std::string group = names::expert_prefix_of(all[experts[first]].name);
    while (last < experts.size() && names::expert_prefix_of(all[experts[last]].name) == group)
      ++last;
    const int64_t K = all[experts[first]].grad.dim(0);
    for (int64_t k = 0; k < K; ++k)
      for (size_t t = first; t < last; ++t) {
        const Param& p = all[experts[t]];
        const int64_t per = p.grad.numel() / K;
        parts.push_back(mine(experts[t]) ? sum_sq(p.grad.dev_f() + k * per, per) : 0.0);
      }
    first = last;
  }
  return parts;
}

double fold(const std::vector<double>& parts) {
  double total = 0;
  for (double v : parts) total += v;
  return total;
}

double grad_sq(const ParamSet& ps) { return fold(grad_sq_parts(ps)); }

}  // namespace sigma
