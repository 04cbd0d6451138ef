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

namespace {

// Owner o's stream: the elements of the tensors it owns, in parameter order. Buckets walk
// every owner's stream at once, S elements of each per round, so that a round moves at most
// R * S elements per rank and no buffer grows with the model (ZeRO's bucketed exchange).
class OwnerStreams {
 public:
  OwnerStreams(const ShardPlan& plan, std::vector<Param>& all, bool grads,
               const std::vector<size_t>* only = nullptr)
      : plan_(plan), lengths_(size_t(plan.ranks), 0) {
    tensors_.resize(size_t(plan.ranks));
    auto add = [&](size_t i) {
      Tensor& t = grads ? all[i].grad : all[i].value;
      tensors_[size_t(plan.owner[i])].push_back({t.dev_f(), size_t(t.numel())});
      lengths_[size_t(plan.owner[i])] += size_t(t.numel());
    };
    if (only)
      for (size_t i : *only) add(i);
    else
      for (size_t i = 0; i < all.size(); ++i) add(i);
  }
  size_t length(int o) const { return lengths_[size_t(o)]; }
  // Calls fn(pointer, n) over owner o's stream elements [begin, end) in order.
  template <class Fn>
  void spans(int o, size_t begin, size_t end, Fn&& fn) const {
    size_t at = 0;
    for (const auto& [p, n] : tensors_[size_t(o)]) {
      const size_t b = std::max(begin, at), e = std::min(end, at + n);
      if (b < e) fn(p + (b - at), e - b);
      at += n;
      if (at >= end) break;
    }
  }
  // The tensors live on the backend's device; the exchange buffers are host memory.
  void pack(int o, size_t begin, size_t end, float* out) const {
    spans(o, begin, end, [&](const float* p, size_t n) {
      ops::download(out, p, n * sizeof(float));
      out += n;
    });
  }
  void unpack(int o, size_t begin, size_t end, const float* in) const {
    spans(o, begin, end, [&](float* p, size_t n) {
      ops::upload(p, in, n * sizeof(float));
      in += n;
    });
  }
  // Owner o's share of round k: [begin, end) of its stream.
  std::pair<size_t, size_t> slice(int o, size_t k, size_t S) const {
    const size_t b = std::min(length(o), k * S);
    return {b, std::min(length(o), b + S)};
  }
  // Elements of each owner's stream per round: R of them make a bucket (no more than the
  // longest stream: a small set of tensors gets small buffers).
  size_t slice_elements(size_t bucket) const {
    size_t most = 1;
    for (int o = 0; o < plan_.ranks; ++o) most = std::max(most, length(o));
    return std::min(most, std::max<size_t>(1, bucket / size_t(plan_.ranks)));
  }
  size_t rounds(size_t S) const {
    size_t most = 0;
    for (int o = 0; o < plan_.ranks; ++o) most = std::max(most, length(o));
    return (most + S - 1) / S;
  }

 private:
  const ShardPlan& plan_;
  std::vector<size_t> lengths_;                                  // per owner
  std::vector<std::vector<std::pair<float*, size_t>>> tensors_;  // per owner
};

}  // namespace

void reduce_to_owners(Communicator& comm, const ShardPlan& plan, ParamSet& ps, size_t bucket,
                      const std::vector<size_t>* only) {
  const int R = comm.size(), me = comm.rank();
  SIGMA_CHECK(plan.ranks == R, "shard plan for {} ranks used with {}", plan.ranks, R);
  if (R == 1) return;
  const OwnerStreams grads(plan, ps.all(), true, only);
  const size_t S = grads.slice_elements(bucket);
  std::vector<float> send(S * size_t(R)), recv(S * size_t(R)), sum(S);
  std::vector<int64_t> send_counts(static_cast<size_t>(R)), recv_counts(static_cast<size_t>(R));
  std::vector<const float*> parts(static_cast<size_t>(R));
  for (size_t k = 0, rounds = grads.rounds(S); k < rounds; ++k) {
    // To each owner its slice of this round, straight from the gradient tensors.
    float* at = send.data();
    for (int o = 0; o < R; ++o) {
      const auto [b, e] = grads.slice(o, k, S);
      grads.pack(o, b, e, at);
      at += e - b;
      send_counts[size_t(o)] = int64_t(e - b);
    }
    const auto [b, e] = grads.slice(me, k, S);
    std::fill(recv_counts.begin(), recv_counts.end(), int64_t(e - b));
    comm.all_to_all_v(send.data(), send_counts.data(), recv.data(), recv_counts.data());
    // The R ranks' parts of my slice, added in rank order (tree_sum), into my gradients.
    for (int r = 0; r < R; ++r) parts[size_t(r)] = recv.data() + size_t(r) * (e - b);
    tree_sum(sum.data(), parts.data(), R, int64_t(e - b));
    grads.unpack(me, b, e, sum.data());
  }
}

void gather_from_owners(Communicator& comm, const ShardPlan& plan, ParamSet& ps, size_t bucket) {
  const int R = comm.size(), me = comm.rank();
  if (R == 1) return;
  const OwnerStreams values(plan, ps.all(), false);
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
