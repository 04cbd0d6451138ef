// Experts in checkpoints (docs/checkpoints.md): per expert group (RRE block l, group G) a pair
// of files under the tensor names an in-model checkpoint uses, so that every other command
// reads them:
//   experts.l.G.safetensors       blocks.l.rre.G.{w_in,b_in,w_out,b_out} stacked [K, ...]
//   experts.l.G.adam.safetensors  their .m and .v, the per-expert step counts
//                                 blocks.l.rre.G.steps I64 [K], and .step scalars (the
//                                 group's largest step) for an in-model run resuming from it
// Written and read by the executors whose experts live outside the model's parameters: ECSS
// (one store with every expert) and expert parallelism (each rank's store holds a range of
// each group's experts).
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "ecss/expert_store.h"
#include "io/checkpoint_dir.h"
#include "io/checkpoint_shards.h"

namespace sigma {

// What a training run's checkpoint needs from an executor that keeps experts outside the model.
class ExpertFiles {
 public:
  virtual ~ExpertFiles() = default;
  // Every rank calls it before any rank writes (a collective where experts are spread over
  // ranks: each group's writing rank receives it).
  virtual void collect() {}
  // Each rank adds the expert group files it writes (into its own writer, or rank 0's).
  virtual void add_checkpoint_files(CheckpointWriter& w) const = 0;
  // The files rank `rank` (> 0) adds, in an order every rank knows: rank 0 records their
  // sizes and checksums in the one manifest. Default: rank 0 writes them all.
  virtual std::vector<std::string> files_of_rank(int /*rank*/) const { return {}; }
  // A sharded checkpoint (io/checkpoint_shards.h): true when this executor adds each rank's
  // own experts as pieces (add_shard_tensors, called by every rank: it may be a collective);
  // false keeps the whole expert group files.
  virtual bool shardable() const { return false; }
  virtual void add_shard_tensors(ShardContents& /*out*/) {}
  // Every rank, after the checkpoint `dir` is committed.
  virtual void checkpoint_written(const std::string& /*dir*/) {}
  // Every rank restores its experts from checkpoint directory `dir`.
  virtual void load(const std::string& dir) = 0;
};

// "experts.{block}.{group}.safetensors", or ".adam.safetensors".
std::string expert_group_file(int32_t block, const std::string& group, bool adam);

// Per-expert views of a group of K experts (k = 0 .. K-1), each in the store's record layout.
struct ExpertViews {
  std::function<const float*(int32_t)> weights, m, v;
  std::function<int64_t(int32_t)> step;
};
// Adds group gs's weight file, or its Adam file, from the views (group `name` in the config).
void add_expert_weights_file(CheckpointWriter& w, const ExpertGroupSpec& gs, const std::string& name,
                             const ExpertViews& views);
void add_expert_adam_file(CheckpointWriter& w, const ExpertGroupSpec& gs, const std::string& name,
                          const ExpertViews& views);

// A resume, pass 1, for group gs (all its K experts; named `name` in the config): checks every
// expert tensor's name, dtype and shape in both files and returns the experts' step counts.
// Reads only indexes and step counts, and takes no store, so it cannot change one.
// The files are TensorSources: one file each, or a sharded checkpoint's pieces.
std::vector<int64_t> check_expert_group(const ExpertGroupSpec& gs, const std::string& name,
                                        const TensorSource& model_path, const TensorSource& opt_path);
// Pass 2: copies experts [first, first + count) of group gs into `store`, as experts
// 0 .. count-1 of the store's group (gs.block, gs.group), with their step counts. With
// tp_size > 1 the store holds rank tp_rank's slice of each expert (tp_slice_expert).
void load_expert_group(ExpertStore& store, const ExpertGroupSpec& gs, int32_t first, int32_t count,
                       const std::string& name, const TensorSource& model_path,
                       const TensorSource& opt_path, const std::vector<int64_t>& steps,
                       int tp_size = 1, int tp_rank = 0);

// The checkpoint's pair of files for every group, or model.safetensors / optimizer.safetensors
// when it has none (an in-model run or a surgery output keeps every expert there), or a
// sharded checkpoint's weight and Adam shards.
std::pair<TensorSource, TensorSource> expert_group_paths(const std::string& dir, bool per_group,
                                                       int32_t block, const std::string& group);

}  // namespace sigma
