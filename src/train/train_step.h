// One optimizer step (DESIGN §8-§9): batch -> forward -> backward -> reduce -> clip -> update,
// as separate calls (marian's GraphGroup owns the reduce the same way). The step owns no I/O:
// the run loop (train/trainer.cpp) owns data, checkpoints, metrics and evaluation.
//
// Data parallelism: the step's global batch is `micro` (every rank is given all of it: token
// ids are tiny, and knowing them lets every rank compute masks, loss weights and expert routes
// without an exchange). Rank r of R runs micro-batches [r*k, (r+1)*k), k = micro/R. Gradients
// are summed over micro-batches as tree_sum would over all of them: each rank sums its aligned
// block of k (a power of two when R > 1), the owners of the ZeRO shards add the R block sums
// in rank order. So R = 1, 2, 4 ranks give bit-identical steps at the same global batch and
// threads per rank.
#pragma once
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "core/error.h"
#include "dist/communicator.h"
#include "model/activations.h"
#include "model/model.h"
#include "optim/adamw.h"
#include "parallel/shard_plan.h"
#include "parallel/zero_overlap.h"

namespace sigma {

struct StepResult {
  double grad_norm = 0;  // global L2 norm before clipping (dense and expert gradients)
  float clip = 1.0f;     // the factor gradients were scaled by
  double aux_loss = 0;   // learned gate: weighted load-balancing loss, mean over micro-batches
  // Per model domain: the sum of masked token losses and their count over the global batch
  // (every rank gets the same bits).
  std::vector<double> domain_loss;
  std::vector<int64_t> domain_tokens;
  double loss = 0;       // the step's mean masked token loss over all ranks
  bool skipped = false;  // non-finite loss or grad_norm: no update applied (train/nonfinite.h)
};

class TrainStep {
 public:
  // The model's expert executor (Model::expert_executor) takes part in every step. `plan`
  // says which rank updates which shared parameter (ZeRO-1); `opt` holds state for this rank's.
  TrainStep(Model& model, AdamW& opt, Communicator& comm, const OptimConfig& cfg,
            ShardPlan plan);

  // Makes every expert this rank's micro-batches route to usable (ECSS gathers and binds
  // them). Call before run(); the run loop may start the next step's prefetch in between.
  void prepare(std::span<const Batch> micro);
  // Forward and backward over this rank's micro-batches, each token's loss weighted by its
  // mask over the global batch's mask total; then reduce, mask (frozen parameters, untouched
  // rows), clip to optim.grad_clip, update with learning rate lr, and share the new values.
  // A non-finite loss or gradient norm skips the update (StepResult::skipped).
  StepResult run(std::span<const Batch> micro, float lr, const UpdateMask& mask);

  // The micro-batches of `micro` this rank runs.
  std::span<const Batch> local(std::span<const Batch> micro) const;
  // Tensor parallelism: `tp` is this rank's tp group (parallel/grid.h), `comm` its data group.
  // The gradient norm then adds each split tensor's slices over the group and counts each
  // replicated tensor (and expert) once.
  void set_tensor_parallel(Communicator* tp) { tp_ = tp; }
  // dist.zero = 2: the gradients are sharded too. With one micro-batch per rank each stage of
  // backward (Model::set_grads_done: a block, the head's LayerNorm, the embeddings) goes to
  // its owners as soon as it is finished, and this rank's copies of the other ranks' tensors
  // are released (ops::zero_release), so no rank holds every gradient at once. With several
  // micro-batches per rank the fixed summation tree needs each rank's whole partial sums, so
  // the gradients are reduced after the last one, as with 1, and only then released. The sums
  // are the same either way: the same bits as dist.zero = 1.
  //
  // dist.zero = 3: the parameters' values sharded too. Between steps each rank holds only the
  // values of the tensors it owns (the others' are released: ops::zero_release); a stage's
  // values are gathered from their owners just before a pass reads them
  // (Model::set_params_needed) and released after its last read in that pass
  // (Model::set_params_done): the forward's, then again for backward (the last block is kept
  // from its forward to its backward). With dist.overlap the next stage's gather runs while
  // the current one computes. The update writes the owners' values only, so nothing is
  // gathered after it. The gradients are sharded as with 2. The gathered values are the
  // owners' bits: the same bits as dist.zero = 1. The held-out evaluation reads them stage by
  // stage too (forward_only); a sharded save needs only each rank's own (settle_owned).
  // Anything else that reads the parameters between steps calls settle() first, which gathers
  // them whole; the next run() releases them again.
  void set_zero_stage(int stage) { zero_ = stage; }
  // dist.overlap: ZeRO's exchanges hidden behind compute (parallel/zero_overlap.h). Each stage
  // of the last micro-batch's backward starts its gradients' reduction as soon as it is
  // finished (with several micro-batches per rank, the stage's tree of partial sums is folded
  // first, in the same order as without overlap); the reductions are completed after
  // backward. The updated values go out after the update, overlapped with the experts'
  // update, and are completed there, or with `defer_gather` only where the next step's
  // forward first reads each stage (Model::set_params_needed); then anything else that reads
  // the parameters between steps must call settle() first. Between, the exchanges advance at
  // every layer boundary (a test of what is in flight). The same sums in the same order: the
  // same bits as without overlap. With a fault-injection hook (set_after_backward) the
  // reductions start after it, in the same order. With dist.zero = 3 the hook must be set on
  // every rank or on none: its stages' gathers during backward are matched in order with the
  // reductions that a rank without the hook starts during backward.
  // max_in_flight: the most elements of exchange buffers in flight (ZeroOverlap's bound; one
  // round alone may exceed it); 0 = the stage's default (overlap_bound). Set before the first
  // overlapped step: the bound is fixed then.
  void set_overlap(bool on, bool defer_gather = false, size_t max_in_flight = 0) {
    SIGMA_CHECK(!zo_ || max_in_flight == max_in_flight_,
                "TrainStep: the overlap's bound is set before the first overlapped step");
    overlap_ = on;
    defer_ = defer_gather;
    max_in_flight_ = max_in_flight;
  }
  // Completes a deferred gather (with dist.zero = 3: gathers every value): every rank's
  // parameters hold the owners' values.
  void settle();
  // Forward passes between steps (held-out evaluation): `passes` runs them, on the step's own
  // activations (no second set). With dist.zero = 3 they read the parameters as the training
  // forward does: each stage's values gathered from their owners just before it is read and
  // released after (Model::set_params_needed / set_params_done), so no rank holds every value
  // at once; the same owners' bits as settle() then a plain forward. Otherwise settle() first.
  // Every rank calls it with the same passes (the gathers are collective).
  void forward_only(const std::function<void(Activations&)>& passes);
  // Completes the exchanges in flight without gathering the other ranks' values: each rank's
  // own values and Adam state are then final (a save of each rank's owned tensors: the
  // sharded layout under dist.zero = 3, train/checkpoint_sharded.h). settle() otherwise.
  void settle_owned();
  // Every value was just written whole (a checkpoint load): under dist.zero = 3 the ones this
  // rank does not own are given back now rather than where the first step reads them.
  void values_written();
  // Whether a rank holds only the values it owns between steps (dist.zero = 3 on R > 1 ranks).
  bool values_sharded() const { return zero3(); }
  // dist.zero = 3: the most elements of other ranks' expert tensors this rank has held gathered
  // at once (one expert's at most where the model reads its experts one by one).
  int64_t peak_gathered_expert_elements() const { return peak_experts_; }
  // Seconds this rank spent blocked in overlapped exchanges (ZeroOverlap::blocked_s).
  double overlap_blocked_s() const { return zo_ ? zo_->blocked_s() : 0.0; }
  // The most elements of overlapped exchange buffers in flight at once
  // (ZeroOverlap::peak_in_flight). With dist.zero = 3 the bound is twice the largest stage's
  // elements, at most two buckets (one round alone may exceed it): about one round at a time.
  size_t overlap_peak_in_flight() const { return zo_ ? zo_->peak_in_flight() : 0; }
  // Fault injection for tests: called after each micro-batch's backward (may poison gradients).
  void set_after_backward(std::function<void(ParamSet&)> f) { after_backward_ = std::move(f); }

 private:
  void check_split(size_t micro) const;
  void sum_losses(const Batch& b, size_t slot, std::vector<double>& per_slot) const;
  void tp_norm_parts(std::vector<double>& parts) const;
  // ZeRO-3 (set_zero_stage): stage s of Model::param_stages gathered / released.
  bool zero3() const { return zero_ == 3 && comm_.size() > 1; }
  size_t zero_bucket() const { return zero3() ? kZero3BucketElements : kZeroBucketElements; }
  void need_stage(size_t s);
  void done_stage(size_t s);
  void release_stage(size_t s);
  std::vector<size_t> backward_stages() const;
  // Releases the elements of piece p of t (a value or gradient) that this rank does not own.
  void release_others(Tensor& t, const ParamPiece& p) const;

  Model& model_;
  AdamW& opt_;
  Communicator& comm_;
  Communicator* tp_ = nullptr;
  int zero_ = 1;
  bool overlap_ = false, defer_ = false;
  size_t max_in_flight_ = 0;  // set_overlap; 0: overlap_bound's default
  size_t overlap_bound() const;
  std::unique_ptr<ZeroOverlap> zo_;
  // ZeRO-3, per stage: its values are gathered (held) / their gather is in flight (pending).
  // Every value is held until the first run(). order_: the stages in the order the current
  // micro-batch's passes ask for them (forward then backward); at_: the next one expected.
  std::vector<ParamPiece> owned_;  // [params]: this rank's elements of each (shard plan)
  std::vector<uint8_t> held_, pending_;
  std::vector<size_t> order_;
  int64_t peak_experts_ = 0;
  size_t at_ = 0, head_at_ = 0;  // head_at_: where the tied head's stage is in order_
  bool in_backward_ = false;
  OptimConfig cfg_;
  ShardPlan plan_;
  Activations acts_;
  std::vector<float> token_loss_, weight_;
  std::function<void(ParamSet&)> after_backward_;
};

}  // namespace sigma
