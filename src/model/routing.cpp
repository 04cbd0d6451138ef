#include "model/routing.h"

#include <algorithm>
#include <numeric>
#include <queue>
#include <tuple>

#include "core/error.h"
#include "core/rng.h"
#include "model/names.h"

namespace sigma {

std::vector<int32_t> routing_permutation(int64_t V, uint64_t seed, int block,
                                         const std::string& group) {
  std::vector<int32_t> perm(static_cast<size_t>(V));
  std::iota(perm.begin(), perm.end(), 0);
  Rng r(seed, stream_of(names::routing(block, group).c_str()));
  for (int64_t i = V - 1; i > 0; --i) {
    const auto j = static_cast<int64_t>(r.below(static_cast<uint32_t>(i + 1)));
    std::swap(perm[size_t(i)], perm[size_t(j)]);
  }
  return perm;
}

std::vector<int32_t> random_routing_table(int64_t V, int K, uint64_t seed, int block,
                                          const std::string& group) {
  SIGMA_CHECK(K >= 1, "routing table {} needs at least one expert", names::routing(block, group));
  const auto perm = routing_permutation(V, seed, block, group);
  std::vector<int32_t> table(size_t(V), 0);
  for (int64_t i = 0; i < V; ++i) table[size_t(perm[size_t(i)])] = int32_t(i % K);
  return table;
}

std::vector<int32_t> frequency_routing_table(const std::vector<int64_t>& counts, int K,
                                             uint64_t seed, int block, const std::string& group) {
  SIGMA_CHECK(K >= 1, "routing table {} needs at least one expert", names::routing(block, group));
  const int64_t V = int64_t(counts.size());
  // Order ids by decreasing count; equal counts keep the seeded permutation's order.
  std::vector<int32_t> ids = routing_permutation(V, seed, block, group);
  std::stable_sort(ids.begin(), ids.end(),
                   [&](int32_t a, int32_t b) { return counts[size_t(a)] > counts[size_t(b)]; });
  // Min-heap of (token load, ids held, expert).
  using Slot = std::tuple<int64_t, int64_t, int32_t>;
  std::priority_queue<Slot, std::vector<Slot>, std::greater<Slot>> heap;
  for (int32_t e = 0; e < K; ++e) heap.push({0, 0, e});
  std::vector<int32_t> table(size_t(V), 0);
  for (int32_t id : ids) {
    auto [load, held, e] = heap.top();
    heap.pop();
    table[size_t(id)] = e;
    heap.push({load + std::max<int64_t>(0, counts[size_t(id)]), held + 1, e});
  }
  return table;
}

double expected_imbalance(const std::vector<int32_t>& table, int K,
                          const std::vector<int64_t>& counts) {
  std::vector<double> load(size_t(K), 0.0);
  double total = 0;
  for (size_t i = 0; i < table.size() && i < counts.size(); ++i) {
    load[size_t(table[i])] += double(counts[i]);
    total += double(counts[i]);
  }
  if (total <= 0) return 1.0;
  return *std::max_element(load.begin(), load.end()) / (total / K);
}

}  // namespace sigma
