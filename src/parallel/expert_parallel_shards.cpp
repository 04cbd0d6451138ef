// ExpertParallel's part of a sharded checkpoint (io/checkpoint_shards.h): each rank writes the
// records of the experts it holds, as they are in its store (its tp slice of each), viewed in
// place: the stacked tensors' pieces [count, ...] of experts [first, first + count).
// The placement can give ranks unequal numbers of experts (groups of 2, 3 and 4 experts over 4
// ranks: 2, 6, 4 and 6 experts in 2 blocks), and experts are most of a checkpoint; so the
// weights and Adam moments of a few (block, group) ranges go to a less loaded rank of the data
// group to write (one all-to-all-v), which evens the files out. The per-expert step counts
// stay with the holder. The pieces' geometry is the holder's, so the readers see no difference.
#include <algorithm>
#include <iterator>
#include <numeric>

#include "ecss/expert_store.h"
#include "model/names.h"
#include "model/tensor_parallel.h"
#include "parallel/expert_parallel.h"

namespace sigma {

namespace ep_shard_balance {

// A (block, group) range of experts held by `holder` and written by `writer`.
struct Unit {
  int block, group, holder, writer;
  int32_t first, count;
};

// Every rank's held ranges, each with the rank that writes it: the holder, unless moving the
// range to the least loaded rank (one that writes nothing of that (block, group) yet, as a
// file holds one piece per tensor) lowers the most loaded rank's floats. Greedy, from the
// placement alone: every rank computes the same moves.
std::vector<Unit> plan(const GroupPlacement& placement, const std::vector<int32_t>& experts,
                       int first_block, int layers, int R, int64_t floats_per_expert) {
  std::vector<Unit> units;
  std::vector<double> load(size_t(R), 0.0);
  const size_t G = experts.size();
  std::vector<char> writes(size_t(R) * size_t(layers) * G, 0);  // [rank][block][group]
  auto at = [&](int r, int l, int g) -> char& { return writes[(size_t(r) * size_t(layers) + size_t(l)) * G + size_t(g)]; };
  for (int l = first_block; l < layers; ++l)
    for (size_t g = 0; g < G; ++g) {
      const std::vector<int>& ranks = placement.ranks[g];
      for (size_t m = 0; m < ranks.size(); ++m) {
        const int32_t a = GroupPlacement::first(experts[g], ranks.size(), m);
        const int32_t b = GroupPlacement::first(experts[g], ranks.size(), m + 1);
        if (b == a) continue;
        units.push_back({l, int(g), ranks[m], ranks[m], a, b - a});
        load[size_t(ranks[m])] += double(b - a) * double(floats_per_expert);
        at(ranks[m], l, int(g)) = 1;
      }
    }
  for (size_t moves = 0; moves < units.size(); ++moves) {  // each move lowers the sum of squares
    const int h = int(std::max_element(load.begin(), load.end()) - load.begin());
    const int c = int(std::min_element(load.begin(), load.end()) - load.begin());
    Unit* best = nullptr;
    for (Unit& u : units) {
      const double n = double(u.count) * double(floats_per_expert);
      if (u.writer != h || at(c, u.block, u.group) || load[size_t(c)] + n >= load[size_t(h)]) continue;
      if (!best || u.count > best->count) best = &u;
    }
    if (!best) break;
    const double n = double(best->count) * double(floats_per_expert);
    load[size_t(h)] -= n, load[size_t(c)] += n;
    at(c, best->block, best->group) = 1;
    best->writer = c;
  }
  return units;
}

}  // namespace ep_shard_balance

void ExpertParallel::add_shard_tensors(ShardContents& out) {
  const ModelConfig& cfg = model_.config();
  const TpGroup& tp = model_.tp();
  const int G = int(groups_.size()), L = cfg.layers - first_block_;
  // Each (block, group)'s largest per-expert step over the data group: the ".step" scalars an
  // in-model run resumes from (ecss/expert_files.h), written once (data rank 0, tp rank 0).
  std::vector<double> most(size_t(L) * size_t(G), 0.0), all(most.size() * size_t(world_.size()));
  if (store_)
    for (const ExpertGroupSpec& held : store_->spec().groups)
      for (int32_t k = 0; k < groups_[size_t(held.group)].count; ++k)
        most[size_t(held.block - first_block_) * size_t(G) + size_t(held.group)] = std::max(
            most[size_t(held.block - first_block_) * size_t(G) + size_t(held.group)],
            double(store_->step({held.block, held.group, k})));  // below 2^53: exact
  if (!most.empty()) world_.all_gather(all.data(), most.data(), most.size());
  if (world_.rank() == 0 && tp.rank == 0)
    for (int l = first_block_; l < cfg.layers; ++l)
      for (int g = 0; g < G; ++g) {
        double m = 0;
        for (int r = 0; r < world_.size(); ++r)
          m = std::max(m, all[size_t(r) * most.size() + size_t(l - first_block_) * size_t(G) + size_t(g)]);
        for (const char* leaf : names::kExpertLeaves) {
          out.keep.emplace_back(DType::I64, Shape{});
          *out.keep.back().data<int64_t>() = int64_t(m);
          out.adam.push_back(tensor_ref(names::expert(l, cfg.groups[size_t(g)].name, leaf) + ".step",
                                        out.keep.back()));
        }
      }
  // Which rank writes each held range (ep_shard_balance::plan), and the ranges that travel.
  std::vector<int32_t> K;
  for (const Group& gr : groups_) K.push_back(gr.K);
  const std::vector<ep_shard_balance::Unit> units =
      ep_shard_balance::plan(placement_, K, first_block_, cfg.layers, world_.size(), P_);
  const int me = world_.rank(), R = world_.size();
  // The leaves this tp rank writes (b_out, the same on every tp rank: tp rank 0 only).
  std::vector<size_t> leaves;
  for (size_t t = 0; t < std::size(names::kExpertLeaves); ++t)
    if (!(tp.split() && tp_expert_leaf_split(t).replicated() && tp.rank != 0)) leaves.push_back(t);
  auto piece_of = [&](size_t t, int32_t first, int32_t count, int32_t experts) {
    const TpSplit s = tp.split() ? tp_expert_leaf_split(t) : TpSplit{};
    TensorPiece piece{-1, 1, 1, 0, first, count, experts};
    if (!s.replicated()) piece.dim = s.dim + 1, piece.parts = s.parts, piece.tp = tp.size, piece.rank = tp.rank;
    return piece;
  };
  // Sent in unit order: per leaf, the weights, m and v of each expert of the range.
  std::vector<int64_t> send_counts(size_t(R), 0), recv_counts(size_t(R), 0);
  for (const ep_shard_balance::Unit& u : units) {
    if (u.writer == u.holder) continue;
    const ExpertGroupSpec spec = rre_group_spec(u.block, u.group, u.count, cfg.d_model, f_);
    int64_t n = 0;
    for (size_t t : leaves) n += 3 * int64_t(u.count) * shape_numel(spec.tensors[t].shape);
    if (u.holder == me) send_counts[size_t(u.writer)] += n;
    if (u.writer == me) recv_counts[size_t(u.holder)] += n;
  }
  const int64_t sent = std::accumulate(send_counts.begin(), send_counts.end(), int64_t(0));
  const int64_t received = std::accumulate(recv_counts.begin(), recv_counts.end(), int64_t(0));
  std::vector<float> send(static_cast<size_t>(sent)), recv(static_cast<size_t>(received));
  std::vector<int64_t> send_at(size_t(R), 0);  // where each destination's part starts
  for (int r = 1; r < R; ++r) send_at[size_t(r)] = send_at[size_t(r - 1)] + send_counts[size_t(r - 1)];
  for (const ep_shard_balance::Unit& u : units) {
    if (u.holder != me) continue;
    const ExpertGroupSpec& held = *std::find_if(store_->spec().groups.begin(), store_->spec().groups.end(),
        [&](const ExpertGroupSpec& gs) { return gs.block == u.block && gs.group == u.group; });
    const std::string& name = cfg.groups[size_t(u.group)].name;
    auto id = [&](int32_t k) { return ExpertId{u.block, u.group, k}; };
    for (size_t t : leaves) {
      const int64_t n = shape_numel(held.tensors[t].shape);
      for (int which = 0; which < 3; ++which) {
        std::vector<const float*> recs;
        for (int32_t k = 0; k < u.count; ++k)
          recs.push_back((which == 0 ? store_->weights(id(k)) : which == 1 ? store_->m(id(k)) : store_->v(id(k))) +
                         held.offset(t));
        if (u.writer != me) {  // packed for the writer
          for (const float* r : recs) {
            std::copy(r, r + n, send.data() + send_at[size_t(u.writer)]);
            send_at[size_t(u.writer)] += n;
          }
          continue;
        }
        Shape shape{u.count};
        for (int64_t x : held.tensors[t].shape) shape.push_back(x);
        const std::string base = names::expert(u.block, name, names::kExpertLeaves[t]);
        const std::string tensor = which == 0 ? base : base + (which == 1 ? ".m" : ".v");
        TensorRef r{tensor, DType::F32, shape, nullptr};
        for (const float* p : recs) r.parts.push_back(p);
        (which == 0 ? out.model : out.adam).push_back(std::move(r));
        (which == 0 ? out.model_pieces : out.adam_pieces)[tensor] = piece_of(t, u.first, u.count, K[size_t(u.group)]);
      }
    }
    if (tp.rank != 0) continue;  // the per-expert step counts: the same on every tp rank; the holder's
    out.keep.emplace_back(DType::I64, Shape{u.count});
    for (int32_t k = 0; k < u.count; ++k) out.keep.back().data<int64_t>()[k] = store_->step(id(k));
    const std::string steps = names::expert(u.block, name, "steps");
    out.adam.push_back(tensor_ref(steps, out.keep.back()));
    out.adam_pieces[steps] = TensorPiece{-1, 1, 1, 0, u.first, u.count, K[size_t(u.group)]};
  }
  if (sent + received == 0) return;
  world_.all_to_all_v(send.data(), send_counts.data(), recv.data(), recv_counts.data());
  send = {};
  // The received ranges, in the holders' order and each holder's unit order (as packed).
  std::vector<int64_t> recv_at(size_t(R), 0);
  for (int r = 1; r < R; ++r) recv_at[size_t(r)] = recv_at[size_t(r - 1)] + recv_counts[size_t(r - 1)];
  for (const ep_shard_balance::Unit& u : units) {
    if (u.writer != me || u.holder == me) continue;
    const ExpertGroupSpec spec = rre_group_spec(u.block, u.group, u.count, cfg.d_model, f_);
    const std::string& name = cfg.groups[size_t(u.group)].name;
    for (size_t t : leaves) {
      Shape shape{u.count};
      for (int64_t x : spec.tensors[t].shape) shape.push_back(x);
      const std::string base = names::expert(u.block, name, names::kExpertLeaves[t]);
      for (int which = 0; which < 3; ++which) {
        out.keep.emplace_back(DType::F32, shape);
        Tensor& x = out.keep.back();
        std::copy(recv.data() + recv_at[size_t(u.holder)], recv.data() + recv_at[size_t(u.holder)] + x.numel(), x.f());
        recv_at[size_t(u.holder)] += x.numel();
        const std::string tensor = which == 0 ? base : base + (which == 1 ? ".m" : ".v");
        (which == 0 ? out.model : out.adam).push_back(tensor_ref(tensor, x));
        (which == 0 ? out.model_pieces : out.adam_pieces)[tensor] = piece_of(t, u.first, u.count, K[size_t(u.group)]);
      }
    }
  }
}

}  // namespace sigma
