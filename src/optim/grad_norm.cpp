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

int64_t param_rows(const Param& p) { return p.value.shape().empty() ? 1 : p.value.dim(0); }

int64_t slab_rows(const Param& p, int64_t slab) {
  if (p.expert && p.value.shape().size() >= 2) return 1;
  const int64_t width = p.value.numel() / std::max<int64_t>(1, param_rows(p));
  return std::max<int64_t>(1, slab / std::max<int64_t>(1, width));
}

int64_t norm_slabs(const Param& p, int64_t slab) {
  const int64_t per = slab_rows(p, slab);
  return std::max<int64_t>(1, (param_rows(p) + per - 1) / per);
}

std::vector<double> grad_sq_parts(const ParamSet& ps, const std::vector<ParamPiece>& owned,
                                  int64_t slab) {
  std::vector<double> parts;
  // Elements [b, e) of param i are this rank's to add.
  auto mine = [&](size_t i, int64_t b, int64_t e) {
    return owned.empty() || (owned[i].begin <= b && e <= owned[i].end && b < e);
  };
  std::vector<size_t> experts;  // stacked [K, ...]: four per (block, group), in order
  const auto& all = ps.all();
  for (size_t i = 0; i < all.size(); ++i) {
    const Param& p = all[i];
    if (p.expert && p.grad.shape().size() >= 2) {
      experts.push_back(i);
      continue;
    }
    const int64_t n = p.grad.numel();
    const int64_t per = slab_rows(p, slab) * (n / std::max<int64_t>(1, param_rows(p)));
    for (int64_t s = 0, slabs = norm_slabs(p, slab); s < slabs; ++s) {
      const int64_t b = s * per, e = std::min(n, b + per);
      parts.push_back(mine(i, b, e) ? sum_sq(p.grad.dev_f() + b, e - b) : 0.0);
    }
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
        parts.push_back(mine(experts[t], k * per, (k + 1) * per)
                            ? sum_sq(p.grad.dev_f() + k * per, per) : 0.0);
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

double grad_sq(const ParamSet& ps, int64_t slab) { return fold(grad_sq_parts(ps, {}, slab)); }

}  // namespace sigma
