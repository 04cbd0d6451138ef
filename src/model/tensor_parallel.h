// Tensor (op-level) model parallelism, Megatron-style (issue 26): the model's side of it. A
// model built for a tp group of size P holds 1/P of each split tensor and runs its blocks on
// those slices; the rest of the model is replicated on every rank of the group.
//
//   attn.qkv.{w,b}  column-parallel by heads: each of Q, K, V keeps heads [P-th part]
//   attn.out.w      row-parallel: the rows of this rank's heads; its output is all-reduced
//   ffn.{w_in,b_in} column-parallel; ffn.w_out row-parallel, its output all-reduced
//   embed.tokens    vocabulary-parallel: rank r holds token ids [rV/P, (r+1)V/P) of every
//                   embedding slot. The lookup reads only those rows (others read as zeros)
//                   and is all-reduced; the tied head scores against them alone, and the
//                   softmax cross-entropy meets the group's per-row statistics (max, sum of
//                   exps, target logit) in one exchange, so no rank holds the [N, V] logits
//   rre.G.{w_in,b_in}  each expert column-parallel, rre.G.w_out row-parallel (its b_out
//                   replicated, added once): the dense FFN's split applied per expert, since
//                   the ranks of a tp group run the same rows through the same experts
//   everything else replicated (LayerNorms, biases of row-parallel layers, the position and
//   query tables, the learned gate)
//
// This table (tp_split) is the one place where a tensor's shard is decided: register_params
// registers local shapes from it, the initialisation and checkpoint loading slice full tensors
// with it, checkpoint saving reassembles them with it.
//
// Replicated parameters get identical gradients on every rank of the group by construction:
// each is computed only from tensors that are identical there (the residual stream after the
// all-reduces, the LayerNorm outputs, dL/d(block output)), so the ranks update them alike.
//
// The model layer does not see communicators: TpGroup's reducer is the seam (parallel/grid.h
// implements it on a Communicator), as ExpertExecutor is for expert parallelism.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/tensor.h"
#include "model/config.h"

namespace sigma {

class TpReducer {
 public:
  virtual ~TpReducer() = default;
  // data[n] = the sum over the group's ranks, the same bits on each (a fixed order). data is
  // device memory (the model's activations and gradients; dist/communicator.h's contract).
  virtual void all_reduce_sum(float* data, int64_t n) = 0;
};

struct TpGroup {
  int rank = 0, size = 1;
  TpReducer* reducer = nullptr;  // required when size > 1
  bool split() const { return size > 1; }
  void all_reduce(float* data, int64_t n) const {
    if (size > 1) reducer->all_reduce_sum(data, n);
  }
  // A row-parallel layer's bias is added once, by rank 0, before its output is all-reduced.
  const float* row_bias(const float* b) const { return rank == 0 ? b : nullptr; }
};

// How a tensor is split over the tp group: along `dim`, which is viewed as `parts` equal
// blocks (QKV: 3), each cut into P contiguous slices; rank r keeps slice r of every block.
// dim < 0: replicated.
struct TpSplit {
  int dim = -1;
  int parts = 1;
  bool replicated() const { return dim < 0; }
};
// The split of parameter `name` of a model of config `cfg` (its embedding slots: the parts of
// embed.tokens).
TpSplit tp_split(const ModelConfig& cfg, const std::string& name);

// The split of an expert's leaf t (names::kExpertLeaves order) as one expert holds it, unstacked
// (w_in [d,f], b_in [f], w_out [f,d], b_out [d]): the expert store's records and the expert
// files' per-expert slices. The stacked in-model tensors [K, ...] split one dimension later.
TpSplit tp_expert_leaf_split(size_t t);

// The shape rank r holds of a tensor of shape `full`.
Shape tp_local_shape(const Shape& full, TpSplit s, int size);
// Host copies: rank `rank`'s slice of a full tensor, and the full tensor from every rank's
// slice (locals[r] = rank r's, each of tp_local_shape). Any element type (4-byte floats here).
void tp_slice(float* local, const float* full, const Shape& full_shape, TpSplit s, int size, int rank);
void tp_assemble(float* full, const float* const* locals, const Shape& full_shape, TpSplit s, int size);

// One expert's record, w_in [d,f] | b_in [f] | w_out [f,d] | b_out [d] (the expert store's
// layout, Model::bind_expert's): rank `rank`'s record (f/size columns, b_out whole) cut from
// the whole one, and the whole record from every rank's (locals[r]: rank r's).
void tp_slice_expert(float* local, const float* whole, int64_t d, int64_t f, int size, int rank);
void tp_assemble_expert(float* whole, const float* const* locals, int64_t d, int64_t f, int size);

// Row ranges [begin, end) of the whole embedding table ([S*V, d], ascending) as the ranges of
// the rows rank `rank` of `size` holds (a train.freeze mask): ascending, empty ones dropped.
using RowRanges = std::vector<std::pair<int64_t, int64_t>>;
RowRanges tp_local_rows(const RowRanges& rows, int64_t vocab, int size, int rank);

}  // namespace sigma
