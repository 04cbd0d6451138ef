// Expert parallelism inside each domain's expert group (DESIGN §9, docs/distributed.md). The
// experts of group g are spread over the ranks of g's placement, each rank keeping its share,
// with their Adam state, in an expert store of its own (RAM or a file: ECSS per rank). In an
// RRE block each row goes to the rank holding its expert by all-to-all-v on the group's
// communicator and comes back the same way, so rows never leave their group's ranks.
//
// No count exchange: TrainStep gives every rank the step's whole batch (token ids are tiny), so
// each rank computes every rank's routing plan for every block itself, and from it what it
// sends and receives. No capacity, nothing dropped.
//
// The learned-gate baseline (model.router = top1 / top2) runs the same way over its gathered
// rows (model/gate.h), except that its plans depend on the block's input: the members of each
// group exchange their rows per expert in every gated block first (one all-gather), and the
// capacity is the gate's own, per micro-batch as in one process. Every expert is bound each
// step; only those that received rows are updated.
//
// Bit for bit like one process: the holder runs each source rank's rows separately, with the
// rows, threading decision and residual arithmetic that micro-batch gets in one process; it sums
// an expert's gradients over the micro-batches in TrainStep's tree order (per source rank a
// binary counter over its micro-batches, the ranks' subtotals added by tree_sum in rank order);
// and it updates the expert with the store's lazy Adam (eps_rre). R = 1, 2 and 4 ranks therefore
// train the same bits at the same global batch and threads per rank.
//
// With tensor parallelism (model/tensor_parallel.h) `world` is the data group and the store's
// records hold this rank's slice of each expert (f/tp columns); the model sums the rows'
// outputs over the tp group. Checkpoints assemble the records whole over the tp group first
// (set_tensor_parallel), and loading cuts them, so the files are a tp = 1 run's.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "dist/communicator.h"
#include "dist/placement.h"
#include "ecss/expert_files.h"
#include "ecss/expert_store.h"
#include "model/expert_executor.h"
#include "model/model.h"
#include "optim/adamw.h"

namespace sigma {

class ExpertParallel final : public ExpertExecutor, public ExpertFiles {
 public:
  // world: the run's ranks; store_path: this rank's store file ("" = RAM). A new store gets the
  // model's initial weights for this rank's experts; an existing file is refused unless resuming.
  ExpertParallel(Model& model, Communicator& world, GroupPlacement placement,
                 const OptimConfig& optim, const std::string& store_path, bool resuming);
  ~ExpertParallel() override;
  ExpertParallel(const ExpertParallel&) = delete;
  ExpertParallel& operator=(const ExpertParallel&) = delete;

  int64_t owned_experts() const;         // experts this rank holds (all RRE blocks)
  // Every expert's parameters (whole, over a tp group's slices too).
  int64_t all_expert_params() const {
    const int64_t d = model_.config().d_model, f = model_.config().ffn();
    return int64_t(blocks_) * E_ * (2 * d * f + f + d);
  }
  // The model's tp group as a communicator (checkpoints assemble the experts' slices whole
  // over it); needed when the model is split over more than one rank.
  void set_tensor_parallel(Communicator* tp) { tp_ = tp; }
  // This rank's store (null when it holds no expert); its group g's expert k is the group's
  // expert first_held(g) + k.
  const ExpertStore* store() const { return store_ ? &*store_ : nullptr; }
  int32_t first_held(int g) const { return groups_[size_t(g)].first; }
  int64_t store_bytes() const;           // their records, with Adam state
  bool file_backed() const { return store_ && store_->file_backed(); }
  // What this rank sent on each group's communicator (calls; bytes per world rank, self
  // included); empty for groups it is not in.
  std::vector<CommStats> group_traffic() const;
  const GroupPlacement& placement() const { return placement_; }

  // An evaluation's batch, the same on every rank: each rank runs its experts' rows and the
  // results are summed over the ranks (exact: every row has one holder, the others add zeros).
  void begin_step(std::span<const Batch> micro) override;
  void begin_global_step(std::span<const Batch> micro, size_t first, size_t count) override;
  void begin_micro_batch(size_t j) override;
  void end_micro_batch() override;
  void forward(int block, const RreWeights& w, const RrePlan& p, const ExpertBuffers& b, float* y,
               const float* x, int64_t N, int64_t d, int64_t f) override;
  void backward(int block, const RreWeights& w, const RrePlan& p, const ExpertBuffers& b,
                float* dx, const float* dy, const float* x, int64_t N, int64_t d,
                int64_t f) override;
  // Pieces of every expert active in the global batch, in the canonical order: this rank's
  // from its gradients, the others' zero (the all-reduce over ranks fills them in exactly).
  void append_grad_sq_parts(std::vector<double>& parts) const override;
  void update(float lr, float grad_scale) override;

  // Checkpoints: the records of each (RRE block, group) pair come to one member of the group
  // (the pairs take the members in turn: writer_of), which writes ecss/expert_files.h's pair
  // of files for it, all ranks in parallel (in dist.ckpt_writers waves); a checkpoint of any
  // rank count, or an ECSS or in-model one, loads on any other.
  void collect() override;
  void add_checkpoint_files(CheckpointWriter& w) const override;
  std::vector<std::string> files_of_rank(int rank) const override;
  int writer_of(int block, int group) const;
  void checkpoint_written(const std::string& dir) override;
  void load(const std::string& dir) override;
  // A sharded checkpoint (dist.ckpt_layout = sharded): each rank's own experts, its tp slice
  // of each, as pieces of the stacked tensors; a few ranges travel to a less loaded rank to
  // write, so that the files even out, and each group's largest step to rank 0
  // (expert_parallel_shards.cpp).
  bool shardable() const override { return true; }
  void add_shard_tensors(ShardContents& out) override;

 private:
  struct Chunk;       // one source rank's rows for this rank's experts in one group
  struct BlockState;  // one RRE block's chunks and saved activations
  struct Group {      // this rank's part in expert group g (every RRE block alike)
    std::unique_ptr<Communicator> comm;  // null when not a member
    int32_t first = 0, count = 0;        // the experts it holds: [first, first + count)
    int32_t E0 = 0, K = 0;               // global index of the group's expert 0; its experts
  };
  void bind_step_experts(std::span<const Batch> micro);
  void exchange(Communicator& c, const std::vector<float>& send, const std::vector<int64_t>& send_rows,
                std::vector<float>& recv, const std::vector<int64_t>& recv_rows, int64_t width);
  void forward_replicated(const RreWeights& w, const RrePlan& p, const ExpertBuffers& b, float* y,
                          const float* x, int64_t N, int64_t d, int64_t f);
  const RrePlan& plan_of(int block, const RreWeights& w, int source_rank);
  void exchange_plans(int block, Communicator& c, const RrePlan& p);
  std::vector<int64_t> rows_per_holder(const Group& gr, const RrePlan& p) const;
  Chunk chunk_from(int g, int member, int source, const RrePlan& q) const;
  ExpertId local(ExpertId id) const { return {id.block, id.group, id.expert - groups_[size_t(id.group)].first}; }
  bool holds(int g, int32_t k) const;

  Model& model_;
  Communicator& world_;
  // A group member's rank in world_ from its process-wide rank (Communicator::world_rank):
  // world_ is the data group of a tensor-parallel grid, not always the run's whole world.
  std::vector<int> rank_of_process_;
  int source_of(Communicator& group, int member) const {
    return rank_of_process_[size_t(group.world_rank(member))];
  }
  GroupPlacement placement_;
  OptimConfig optim_;
  std::optional<ExpertStore> store_;  // none when this rank holds no expert
  std::vector<Group> groups_;
  int first_block_ = 0, blocks_ = 0, E_ = 0;
  int64_t f_ = 0;               // this rank's columns of each expert: model.ffn / tp
  int64_t P_ = 0, stride_ = 0;  // floats of one record here (this rank's slice), padded
  Communicator* tp_ = nullptr;
  // The step.
  std::span<const Batch> micro_;
  size_t k_ = 0, j_ = 0;
  bool in_micro_ = false;
  std::vector<ExpertId> global_active_;  // every expert the global batch activates (canonical)
  std::vector<ExpertId> ids_;            // this rank's of them (global expert numbers)
  std::vector<int32_t> slot_;            // [block * E + e]: compute slot, or -1
  std::vector<uint8_t> touched_;         // [ids_]: received rows this step (updated)
  // On the device: the step's weights [ids_, stride_], and per source (world rank) the
  // gradients of its rows in this micro-batch, [ids_, stride_] (empty for non-sources).
  Tensor w_;
  std::vector<Tensor> leaf_;
  // Device scratch of the passes: rows to and from the exchanges, the experts' inputs and
  // outputs, rre_forward's and rre_backward's work buffers. They only grow.
  Tensor rows_d_, in_d_, out_d_, gx_, gy_, gdx_;
  // Host: each source's leaves so far (downloaded after each micro-batch), and the step's sums
  // [ids_, stride_] that the store's Adam reads.
  std::vector<TreeAccumulator> trees_;
  std::vector<float> total_;
  std::vector<std::unique_ptr<BlockState>> state_;  // [RRE block]
  struct Collected {  // collect(): a (block, group) pair this rank writes, all its records
    int block = 0, group = 0;
    std::vector<float> records;
  };
  std::vector<Collected> collected_;
  std::vector<uint8_t> source_;  // [world rank]: shares a group with this rank
  std::vector<uint8_t> mine_;    // [global expert]: held here
};

}  // namespace sigma
