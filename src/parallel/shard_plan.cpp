#include "parallel/shard_plan.h"

#include <algorithm>
#include <cstring>
#include <numeric>

#include "core/error.h"
#include "kernels/ops.h"
#include "parallel/owner_streams.h"

namespace sigma {

std::vector<uint8_t> ShardPlan::owned_by(int rank) const {
  std::vector<uint8_t> out(owner.size());
  for (size_t i = 0; i < owner.size(); ++i) out[i] = owner[i] == rank;
  return out;
}

ShardPlan plan_shards(const ParamSet& ps, int ranks) {
  SIGMA_CHECK(ranks >= 1, "plan_shards: {} ranks", ranks);
  const auto& all = ps.all();
  ShardPlan plan;
  plan.ranks = ranks;
  plan.owner.assign(all.size(), 0);
  plan.elements.assign(size_t(ranks), 0);
  std::vector<size_t> order(all.size());
  std::iota(order.begin(), order.end(), size_t(0));
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return all[a].value.numel() > all[b].value.numel();
  });
  for (size_t i : order) {
    const int r = int(std::min_element(plan.elements.begin(), plan.elements.end()) -
                      plan.elements.begin());
    plan.owner[i] = r;
    plan.elements[size_t(r)] += all[i].value.numel();
  }
  return plan;
}


void reduce_to_owners(Communicator& comm, const ShardPlan& plan, ParamSet& ps, size_t bucket,
                      const ParamStage* only) {
  const int R = comm.size(), me = comm.rank();
  SIGMA_CHECK(plan.ranks == R, "shard plan for {} ranks used with {}", plan.ranks, R);
  if (R == 1) return;
  const zero_detail::OwnerStreams grads(plan, ps.all(), true, only);
  const size_t S = grads.slice_elements(bucket);
  std::vector<float> send(S * size_t(R)), sum(S);
  std::vector<int64_t> send_counts(static_cast<size_t>(R));
  for (size_t k = 0, rounds = grads.rounds(S); k < rounds; ++k) {
    // To each owner its slice of this round, straight from the gradient tensors.
    float* at = send.data();
    for (int o = 0; o < R; ++o) {
      const auto [b, e] = grads.slice(o, k, S);
      grads.pack(o, b, e, at);
      at += e - b;
      send_counts[size_t(o)] = int64_t(e - b);
    }
    // The R ranks' parts of my slice, added in rank order (tree_sum; host-first where ranks
    // share a host: dist/host_first.h), into my gradients.
    comm.reduce_scatter_sum_v(sum.data(), send.data(), send_counts.data());
    const auto [b, e] = grads.slice(me, k, S);
    grads.unpack(me, b, e, sum.data());
  }
}

void gather_from_owners(Communicator& comm, const ShardPlan& plan, ParamSet& ps, size_t bucket,
                        const ParamStage* only) {
  const int R = comm.size(), me = comm.rank();
  if (R == 1 || (only && only->empty())) return;
  const zero_detail::OwnerStreams values(plan, ps.all(), false, only);
  const size_t S = values.slice_elements(bucket);
  std::vector<float> mine(S), every(S * size_t(R));
  std::vector<int64_t> counts(static_cast<size_t>(R));
  for (size_t k = 0, rounds = values.rounds(S); k < rounds; ++k) {
    for (int o = 0; o < R; ++o) {
      const auto [b, e] = values.slice(o, k, S);
      counts[size_t(o)] = int64_t(e - b);
    }
    const auto [b, e] = values.slice(me, k, S);
    values.pack(me, b, e, mine.data());
    comm.all_gather_v(every.data(), mine.data(), counts.data());
    const float* at = every.data();
    for (int o = 0; o < R; ++o) {
      const auto [ob, oe] = values.slice(o, k, S);
      if (o != me) values.unpack(o, ob, oe, at);
      at += oe - ob;
    }
  }
}

}  // namespace sigma
