// Which ranks hold which expert group's experts (DESIGN §9, docs/distributed.md): plain
// arithmetic over ranks and micro-batches, beside the communicator the groups are split from.
// The executor that uses it is parallel/expert_parallel.h.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace sigma {

struct GroupPlacement {
  std::vector<std::vector<int>> ranks;  // [group] world ranks holding its experts, ascending
  // Every group spread over all R ranks.
  static GroupPlacement everywhere(int groups, int R);
  // dist.placement = by_group: micro-batch i of a step's `accum` draws its rows from the domains
  // of group micro_batch_group(i) (contiguous, near-equal shares of the step), and each group
  // lives on the ranks whose aligned block of accum / R micro-batches holds its share.
  static int micro_batch_group(int i, int groups, int accum) { return int(int64_t(i) * groups / accum); }
  static GroupPlacement by_group(int groups, int accum, int R);
  // Member m of a group's n ranks holds its experts [first(K, n, m), first(K, n, m + 1)).
  static int32_t first(int32_t K, size_t n, size_t m) { return int32_t(int64_t(K) * int64_t(m) / int64_t(n)); }
};

// Where each group's experts lie by host, for the run's log: a group on ranks of one host keeps
// its expert exchange inside that host (each row goes to its expert's rank; docs/distributed.md
// "Placement across hosts"); a group over several hosts sends rows across them every RRE block.
// `host` names the host of each rank the placement counts; "" when they share one host.
std::string describe_groups_by_host(const GroupPlacement& p, const std::vector<std::string>& names,
                                    const std::vector<std::string>& host);

}  // namespace sigma
