#include "parallel/shard_plan.h"

#include <algorithm>
#include <cstring>
#include <numeric>

#include "core/error.h"
#include "kernels/ops.h"
#include "parallel/owner_streams.h"

namespace sigma {

std::vector<ParamPiece> ShardPlan::owned_by(int rank) const {
  std::vector<ParamPiece> out;
  out.reserve(cuts.size());
  for (size_t i = 0; i < cuts.size(); ++i) out.push_back(owned(i, rank));
  return out;
}

bool ShardPlan::whole(size_t i) const {
  const std::vector<int64_t>& c = cuts[i];
  for (int r = 0; r < ranks; ++r)
    if (c[size_t(r) + 1] - c[size_t(r)] == c.back()) return true;
  return false;
}

int ShardPlan::owner_of(size_t i, int64_t at) const {
  const std::vector<int64_t>& c = cuts[i];
  for (int r = 0; r + 1 < ranks; ++r)
    if (at < c[size_t(r) + 1]) return r;
  return ranks - 1;
}

namespace {
// The level every rank's load reaches when n more elements fill the least loaded first.
double water_level(std::vector<int64_t> loads, int64_t n) {
  std::sort(loads.begin(), loads.end());
  double below = 0;  // the loads of the k least loaded ranks
  for (size_t k = 1; k <= loads.size(); ++k) {
    below += double(loads[k - 1]);
    const double level = (double(n) + below) / double(k);
    if (k == loads.size() || level <= double(loads[k])) return level;
  }
  return 0;
}
}  // namespace

ShardPlan plan_shards(const ParamSet& ps, int ranks, int64_t slab,
                      const std::function<bool(size_t)>& may_split) {
  SIGMA_CHECK(ranks >= 1, "plan_shards: {} ranks", ranks);
  SIGMA_CHECK(slab >= 1, "plan_shards: a slab of {} elements", slab);
  const auto& all = ps.all();
  const size_t R = size_t(ranks);
  ShardPlan plan;
  plan.ranks = ranks;
  plan.slab = slab;
  plan.cuts.resize(all.size());
  plan.elements.assign(R, 0);
  int64_t total = 0;
  for (const Param& p : all) total += p.value.numel();
  std::vector<size_t> order(all.size());
  std::iota(order.begin(), order.end(), size_t(0));
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return all[a].value.numel() > all[b].value.numel();
  });
  for (size_t i : order) {
    const Param& p = all[i];
    const int64_t n = p.value.numel();
    std::vector<int64_t>& cut = plan.cuts[i];
    cut.assign(R + 1, 0);
    const int64_t unit = slab_rows(p, slab) * (n / std::max<int64_t>(1, param_rows(p)));
    const bool split = R > 1 && unit > 0 && unit < n && 2 * n * int64_t(R) > total &&
                       (!may_split || may_split(i));
    if (split) {  // rank by rank, each the rows that bring it up to the common level
      const double level = water_level(plan.elements, n);
      double wished = 0;
      for (size_t r = 0; r < R; ++r) {
        wished += std::max(0.0, level - double(plan.elements[r]));
        const int64_t at = std::llround(wished / double(unit)) * unit;
        cut[r + 1] = r + 1 == R ? n : std::clamp(at, cut[r], n);
      }
    } else {
      const size_t o = size_t(std::min_element(plan.elements.begin(), plan.elements.end()) -
                              plan.elements.begin());
      for (size_t r = o; r < R; ++r) cut[r + 1] = n;
    }
    for (size_t r = 0; r < R; ++r) plan.elements[r] += cut[r + 1] - cut[r];
  }
  return plan;
}

void add_outside(std::vector<ParamPiece>& out, const ParamPiece& p, const ParamPiece& mine) {
  if (mine.begin >= mine.end) {
    out.push_back(p);
    return;
  }
  if (p.begin < std::min(p.end, mine.begin)) out.push_back({p.param, p.begin, std::min(p.end, mine.begin)});
  if (std::max(p.begin, mine.end) < p.end) out.push_back({p.param, std::max(p.begin, mine.end), p.end});
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
