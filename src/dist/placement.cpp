#include "dist/placement.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
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

std::string describe_groups_by_host(const GroupPlacement& p, const std::vector<std::string>& names,
                                    const std::vector<std::string>& host) {
  std::vector<std::string> all_hosts = host;
  std::sort(all_hosts.begin(), all_hosts.end());
  all_hosts.erase(std::unique(all_hosts.begin(), all_hosts.end()), all_hosts.end());
  if (all_hosts.size() < 2) return "";
  std::vector<std::string> parts;
  size_t spanning = 0;
  for (size_t g = 0; g < p.ranks.size(); ++g) {
    std::vector<std::string> on;  // the group's hosts, in rank order
    for (int r : p.ranks[g]) {
      SIGMA_CHECK(r >= 0 && size_t(r) < host.size(), "expert group {} is placed on rank {} of {}",
                  g, r, host.size());
      if (std::find(on.begin(), on.end(), host[size_t(r)]) == on.end()) on.push_back(host[size_t(r)]);
    }
    spanning += on.size() > 1;
    const std::vector<int>& rs = p.ranks[g];
    const std::string ranks =
        rs.size() == 1 ? fmt::format("rank {}", rs[0])
        : size_t(rs.back() - rs.front()) + 1 == rs.size()
            ? fmt::format("ranks {}-{}", rs.front(), rs.back())
            : fmt::format("ranks {}", fmt::join(rs, ","));
    parts.push_back(fmt::format("{} on {} ({})", g < names.size() ? names[g] : std::to_string(g),
                                fmt::join(on, "+"), ranks));
  }
  const std::string where = fmt::format("{}", fmt::join(parts, ", "));
  if (spanning == 0)
    return fmt::format("expert groups by host: {}: every group's expert exchange stays inside its "
                       "host", where);
  return fmt::format("expert groups by host: {}: {} of {} groups span hosts, so their rows cross "
                     "hosts in every RRE block (dist.placement = by_group keeps a group on the ranks "
                     "of its micro-batches)", where, spanning, p.ranks.size());
}

}  // namespace sigma
