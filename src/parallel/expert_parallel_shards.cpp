// ExpertParallel's part of a sharded checkpoint (io/checkpoint_shards.h): each rank writes the
// records of the experts it holds, as they are in its store (its tp slice of each), viewed in
// place: the stacked tensors' pieces [count, ...] of experts [first, first + count).
#include <algorithm>

#include "model/names.h"
#include "model/tensor_parallel.h"
#include "parallel/expert_parallel.h"

namespace sigma {

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
  if (!store_) return;
  for (const ExpertGroupSpec& held : store_->spec().groups) {
    const Group& gr = groups_[size_t(held.group)];
    if (gr.count == 0) continue;
    const std::string& name = cfg.groups[size_t(held.group)].name;
    auto id = [&](int32_t k) { return ExpertId{held.block, held.group, k}; };
    for (size_t t = 0; t < held.tensors.size(); ++t) {
      const TpSplit s = tp.split() ? tp_expert_leaf_split(t) : TpSplit{};
      if (s.replicated() && tp.rank != 0) continue;  // b_out: the same on every tp rank
      TensorPiece piece{-1, 1, 1, 0, gr.first, gr.count, gr.K};
      if (!s.replicated()) piece.dim = s.dim + 1, piece.parts = s.parts, piece.tp = tp.size, piece.rank = tp.rank;
      const std::string base = names::expert(held.block, name, names::kExpertLeaves[t]);
      Shape shape{gr.count};
      for (int64_t x : held.tensors[t].shape) shape.push_back(x);
      const ExpertStore& store = *store_;
      auto stacked = [&](std::string tensor, int which) {  // 0 weights, 1 m, 2 v
        TensorRef r{std::move(tensor), DType::F32, shape, nullptr};
        for (int32_t k = 0; k < gr.count; ++k) {
          const float* rec = which == 0 ? store.weights(id(k)) : which == 1 ? store.m(id(k)) : store.v(id(k));
          r.parts.push_back(rec + held.offset(t));
        }
        return r;
      };
      out.model.push_back(stacked(base, 0));
      out.model_pieces[base] = piece;
      out.adam.push_back(stacked(base + ".m", 1));
      out.adam_pieces[base + ".m"] = piece;
      out.adam.push_back(stacked(base + ".v", 2));
      out.adam_pieces[base + ".v"] = piece;
    }
    if (tp.rank != 0) continue;  // the per-expert step counts: the same on every tp rank
    out.keep.emplace_back(DType::I64, Shape{gr.count});
    for (int32_t k = 0; k < gr.count; ++k) out.keep.back().data<int64_t>()[k] = store_->step(id(k));
    const std::string steps = names::expert(held.block, name, "steps");
    out.adam.push_back(tensor_ref(steps, out.keep.back()));
    out.adam_pieces[steps] = TensorPiece{-1, 1, 1, 0, gr.first, gr.count, gr.K};
  }
}

}  // namespace sigma
