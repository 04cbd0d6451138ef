#include "parallel/shard_plan.h"

#include <algorithm>
#include <cstring>
#include <numeric>

#include "core/error.h"
#include "kernels/ops.h"

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

void reduce_to_owners(Communicator& comm, const ShardPlan& plan, ParamSet& ps) {
  const int R = comm.size(), me = comm.rank();
  SIGMA_CHECK(plan.ranks == R, "shard plan for {} ranks used with {}", plan.ranks, R);
  if (R == 1) return;
  auto& all = ps.all();
  // Send: every gradient, packed by owner (in parameter order within each owner's block).
  std::vector<int64_t> send_counts(plan.elements), recv_counts(size_t(R), plan.elements[size_t(me)]);
  std::vector<int64_t> at(size_t(R), 0);
  for (int r = 1; r < R; ++r) at[size_t(r)] = at[size_t(r - 1)] + send_counts[size_t(r - 1)];
  std::vector<float> send(size_t(at.back() + send_counts.back()));
  for (size_t i = 0; i < all.size(); ++i) {
    const int o = plan.owner[i];
    const int64_t n = all[i].grad.numel();
    ops::download(send.data() + at[size_t(o)], all[i].grad.f(), size_t(n) * sizeof(float));
    at[size_t(o)] += n;
  }
  const int64_t mine = plan.elements[size_t(me)];
  std::vector<float> recv(size_t(mine) * size_t(R)), sum(static_cast<size_t>(mine));
  comm.all_to_all_v(send.data(), send_counts.data(), recv.data(), recv_counts.data());
  std::vector<const float*> parts(static_cast<size_t>(R));
  for (int r = 0; r < R; ++r) parts[size_t(r)] = recv.data() + size_t(r) * size_t(mine);
  tree_sum(sum.data(), parts.data(), R, mine);
  int64_t off = 0;
  for (size_t i = 0; i < all.size(); ++i) {
    if (plan.owner[i] != me) continue;
    const int64_t n = all[i].grad.numel();
    ops::upload(all[i].grad.f(), sum.data() + off, size_t(n) * sizeof(float));
    off += n;
  }
}

void gather_from_owners(Communicator& comm, const ShardPlan& plan, ParamSet& ps) {
  const int R = comm.size(), me = comm.rank();
  if (R == 1) return;
  auto& all = ps.all();
  std::vector<float> mine(size_t(plan.elements[size_t(me)]));
  int64_t off = 0;
  for (size_t i = 0; i < all.size(); ++i) {
    if (plan.owner[i] != me) continue;
    ops::download(mine.data() + off, all[i].value.f(), size_t(all[i].value.numel()) * sizeof(float));
    off += all[i].value.numel();
  }
  std::vector<float> every(size_t(std::accumulate(plan.elements.begin(), plan.elements.end(), int64_t(0))));
  comm.all_gather_v(every.data(), mine.data(), plan.elements.data());
  std::vector<int64_t> at(size_t(R), 0);
  for (int r = 1; r < R; ++r) at[size_t(r)] = at[size_t(r - 1)] + plan.elements[size_t(r - 1)];
  for (size_t i = 0; i < all.size(); ++i) {
    const int o = plan.owner[i];
    const int64_t n = all[i].value.numel();
    if (o != me)
      ops::upload(all[i].value.f(), every.data() + at[size_t(o)], size_t(n) * sizeof(float));
    at[size_t(o)] += n;
  }
}

}  // namespace sigma
