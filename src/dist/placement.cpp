#include "dist/placement.h"

#include <numeric>

#include "core/error.h"

namespace sigma {

GroupPlacement GroupPlacement::everywhere(int groups, int R) {
  GroupPlacement p;
  std::vector<int> all(static_cast<size_t>(R));
  std::iota(all.begin(), all.end(), 0);
  p.ranks.assign(static_cast<size_t>(groups), all);
  return p;
}

GroupPlacement GroupPlacement::by_group(int groups, int accum, int R) {
  SIGMA_CHECK(accum >= groups, "dist.placement = by_group gives every expert group its own "
              "micro-batches: train.accum ({}) must be at least the number of groups ({})",
              accum, groups);
  SIGMA_CHECK(accum % R == 0, "train.accum ({}) must be a multiple of the ranks ({})", accum, R);
  GroupPlacement p;
  p.ranks.resize(static_cast<size_t>(groups));
  const int k = accum / R;
  for (int i = 0; i < accum; ++i) {
    std::vector<int>& ranks = p.ranks[size_t(micro_batch_group(i, groups, accum))];
    if (ranks.empty() || ranks.back() != i / k) ranks.push_back(i / k);
  }
  return p;
}

}  // namespace sigma
