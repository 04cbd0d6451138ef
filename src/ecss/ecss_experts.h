// ECSS's expert executor (DESIGN §3, §8; docs/ecss.md): the RRE experts and their Adam state
// live in an ExpertStore (RAM or a memory-mapped file); each step only the experts its batch
// activates are gathered into compute buffers, bound to the model (Model::bind_expert), run by
// the local expert code, and updated by the store's lazy Adam with eps_rre. "vanilla" mode is
// the baseline: the same store, but every expert is gathered, bound and updated every step.
//
// Memory budget (train.expert_memory): the compute buffers hold at most budget / (8 P) experts'
// weights and gradients. A step whose active experts fit is gathered once, at its start. A larger one runs
// in pieces: the buffers become a pool of that many slots, and each RRE block's forward and
// backward pass first runs the experts an earlier pass of the step left in the pool (the
// weights change only in update(), so a copy stays valid for the whole step), then gathers the
// rest a pool-full at a time into the slots whose experts the step needs farthest ahead.
// Gradients do not stay in the compute buffers: a backward pass writes its experts' gradients
// into the slots' gradient buffers (zeroed first), and they are then downloaded and added into a
// GradientArea (host memory, or page cache beside a file store), in micro-batch order. That
// gather (store -> compute weights) and scatter (compute gradients -> area) are the ECSS
// boundary's two explicit copies (DESIGN §3); each expert runs once per pass whatever the
// slicing, which makes the bits independent of the budget.
#pragma once
#include <cstdint>
#include <functional>
#include <future>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "ecss/expert_files.h"
#include "ecss/expert_store.h"
#include "ecss/gradient_area.h"
#include "io/checkpoint_dir.h"
#include "io/safetensors.h"
#include "model/batch.h"
#include "model/expert_executor.h"
#include "model/model.h"
#include "optim/adamw.h"

namespace sigma {

enum class ExpertMode { InModel, Ecss, Vanilla, Parallel };

// train.experts with `ranks` ranks: "auto" is ECSS (one rank) or expert parallel (several) for
// models routed by tables, and in-model otherwise (dense models, learned gates); "ecss",
// "vanilla" and "parallel" refuse models they cannot serve, ECSS and vanilla several ranks.
ExpertMode resolve_expert_mode(const std::string& setting, const ModelConfig& cfg, int ranks = 1);
const char* expert_mode_name(ExpertMode m);

// Seconds and counts since construction (or the last reset).
struct OffloadStats {
  double gather_s = 0;    // copying active experts from the store (page faults included)
  double wait_s = 0;      // waiting for the background prefetch to finish
  double update_s = 0;    // the store's Adam over the active experts
  int64_t steps = 0, experts_updated = 0;
  int64_t pieces = 0;            // gathers of applied steps: one per step that fits the
                                 // budget, else one per pool-full an RRE pass copied
  int64_t gathered_bytes = 0;    // weights those gathers copied from the store
  int64_t reused_bytes = 0;      // weights a pass found in the pool, not copied again
  int64_t record_bytes = 0;      // store records the Adam updates read and wrote (each once)
  int64_t compute_bytes = 0;     // the largest compute buffer (expert weights) so far
  int64_t prefetches_skipped = 0;  // next steps whose records outgrew the budget
};

// The store's spec for a model config: one group per (RRE block, expert group).
ExpertStoreSpec expert_store_spec(const ModelConfig& cfg);

class EcssExperts : public LocalExperts, public ExpertFiles {
 public:
  // Opens the store (store_path empty: RAM). A new store gets the model's initial expert
  // weights. An existing store file is refused unless `resuming` (its contents are then
  // replaced by the checkpoint's through load()), so a fresh run never silently continues
  // from, or overwrites, another run's experts. memory_budget: bytes of compute buffers
  // (train.expert_memory); at least one expert's weights.
  EcssExperts(Model& model, ExpertMode mode, const OptimConfig& optim,
              const std::string& store_path, bool resuming, int64_t memory_budget);
  ~EcssExperts();
  EcssExperts(const EcssExperts&) = delete;
  EcssExperts& operator=(const EcssExperts&) = delete;

  const ExpertStore& store() const { return store_; }
  int64_t params() const;  // every expert's parameters
  // One expert's compute buffers: its weights and the gradients of the pass running it.
  int64_t expert_bytes() const { return 2 * stride_ * 4; }
  int64_t budget_experts() const { return budget_experts_; }  // experts the budget holds
  bool grads_in_file() const { return grads_.file_backed(); }
  // The experts these micro-batches activate (every expert in vanilla mode).

  // Step start: the experts the micro-batches route to (every expert in vanilla mode) become
  // the step's set; when they fit the budget they are copied into compute buffers and bound to
  // the model now, else each RRE pass binds its slices. Every other expert is unbound. Gradients
  // of a step that was not applied (skipped as non-finite) are dropped. Waits for a running
  // prefetch first.
  void begin_step(std::span<const Batch> micro) override;
  // The pool evicts the expert whose next use in the step is farthest (Belady's rule): the
  // step knows every micro-batch's experts, and its passes run in a known order.
  void begin_micro_batch(size_t j) override { micro_ = int64_t(j); }
  void end_micro_batch() override { micro_ = -1; }
  // One RRE block's pass: over the bound experts, or slice by slice under the budget.
  void forward(int block, const RreWeights& w, const RrePlan& p, const ExpertBuffers& b, float* y,
               const float* x, int64_t N, int64_t d, int64_t f) override;
  void backward(int block, const RreWeights& w, const RrePlan& p, const ExpertBuffers& b,
                float* dx, const float* dy, const float* x, int64_t N, int64_t d,
                int64_t f) override;
  // Pages in the next step's experts on a background thread (file-backed store only), to
  // overlap with this step's forward and backward; skipped when their records exceed the
  // memory budget (they would evict each other before use).
  void prefetch(std::span<const Batch> next);
  // Squared-norm pieces of the bound experts' gradients (frozen ones add zeros).
  void append_grad_sq_parts(std::vector<double>& parts) const override;
  // Lazy Adam on the step's experts: lr, the clipping scale, eps_rre, and weight decay on
  // w_in / w_out; then their gradients are released. Waits for a running prefetch first.
  void update(float lr, float grad_scale) override;
  // Experts not to update (train.freeze): frozen[(l - first_rre_block) * groups + g]. They are
  // still fetched for the forward pass; their gradients are left out of the norm.
  void set_frozen(std::vector<uint8_t> frozen) { frozen_ = std::move(frozen); }
  const OffloadStats& stats() const { return stats_; }
  int64_t active() const { return int64_t(ids_.size()); }

  // Checkpoints: the pair of files per expert group of ecss/expert_files.h, streamed from the
  // records (no copy). A group none of whose experts was updated since the last checkpoint written or loaded is
  // hard-linked from that checkpoint instead. Call between steps.
  void add_checkpoint_files(CheckpointWriter& w) const override;
  // After the checkpoint `dir` is committed: the base for the next checkpoint's links.
  void checkpoint_written(const std::string& dir) override;
  // A background save (train.ckpt_async): which groups changed since the last checkpoint is
  // taken now; the returned job writes their files on the writer thread, reading the live
  // records (no copy: a file store may exceed RAM). The next update() waits until the job has
  // read them; forward, backward and prefetch only read the store and run meanwhile. Until
  // link_from(dir) names the committed checkpoint, nothing links to it.
  std::function<void(CheckpointWriter&)> checkpoint_later();
  void link_from(const std::string& dir) { last_checkpoint_ = dir; }
  // Restores every expert from checkpoint directory `dir` (its model.safetensors and
  // optimizer.safetensors): every name, dtype, shape and step count is checked before the store
  // changes, then one group of experts at a time is read (a store larger than RAM resumes), and
  // the store is flushed. An optimizer file without per-expert steps (an in-model run, a
  // surgery output) gives every expert of a group its tensors' step.
  void load(const std::string& dir) override;
  // Makes a file-backed store durable and marks it clean.
  void flush() { store_.flush(); }

 private:
  void join_prefetch();
  void join_store_reader();
  void write_groups(CheckpointWriter& w, const std::vector<uint8_t>& changed,
                    const std::string& base) const;
  using Active = std::vector<std::vector<int>>;  // [RRE block] -> a micro-batch's experts
  std::vector<Active> active_of(std::span<const Batch> micro) const;  // per micro-batch
  // The step's experts: those `active` names (vanilla: every expert).
  std::vector<ExpertId> active_ids(const std::vector<Active>& active) const;
  // Empties the pool and gives it `slots` slots (the buffers grow to the largest seen).
  void reset_pool(int64_t slots);
  // Copies `ids` from the store into the pool's least recently used slots and binds them
  // (gradients: their GradientArea slots), unbinding what those slots held.
  void gather_and_bind(std::span<const ExpertId> ids);
  ExpertId expert_id(int block, int e) const;  // e: the expert's index in the block
  // Runs `pass` over block `block`'s experts with rows in plan p: those in the pool first, then
  // the others a pool-full at a time.
  template <class Pass>
  void by_slices(int block, const RrePlan& p, Pass pass);
  // A backward pass over slice `s` of block `block`: zeroes the gradient buffers of its experts
  // with rows, runs `pass`, then adds those buffers into the GradientArea (the scatter out).
  template <class Pass>
  void backward_pass(int block, const RrePlan& p, const ExpertSlice& s, Pass pass);
  // Expert id's gradient slot: its place in ids_ (grad_slot_), so a step touches slots
  // [0, ids_.size()) whichever experts it runs and the area's pages are reused step after step.
  float* grad_of(ExpertId id) const;
  void release_grads();

  Model& model_;
  ExpertMode mode_;
  OptimConfig optim_;
  ExpertStore store_;
  std::vector<int> first_;         // [RRE blocks]: global expert index of each group's expert 0
  int64_t P_ = 0, stride_ = 0;     // floats per expert, and per compute slot (64-byte lines)
  bool is_frozen(ExpertId id) const;
  size_t group_slot(ExpertId id) const;  // index of id's group in store_.spec().groups
  std::vector<uint8_t> frozen_;    // [(RRE block, group)]; empty = none
  std::vector<ExpertId> ids_;      // the step's experts, in (block, group, expert) order
  std::vector<int32_t> grad_slot_; // [store ordinal] its place in ids_, -1 when not in the step
  bool whole_step_ = false;        // ids_ fit the budget: bound for the whole step
  bool grads_pending_ = false;     // ids_' gradients not yet applied and released
  int64_t budget_experts_ = 0, memory_budget_ = 0;
  int64_t step_pieces_ = 0, step_gathered_ = 0, step_reused_ = 0;  // added to stats_ by update()
  Tensor w_;                       // compute buffers [>= slots, stride_]: weights
  Tensor g_;                       // and one backward pass's gradients, slot for slot
  // The pool over w_'s first slots: what each holds (bound to the model), when it was last used.
  std::vector<ExpertId> slot_id_;
  std::vector<uint8_t> slot_full_;
  std::vector<int64_t> slot_used_;
  std::vector<int32_t> slot_of_;   // [store ordinal] its slot, -1 when not in the pool
  int64_t uses_ = 0;
  // Farthest-next-use eviction: used_in_[j][store ordinal] = micro-batch j runs that expert;
  // the current pass (micro_ = -1 outside a training micro-batch: least recently used then).
  std::vector<std::vector<uint8_t>> used_in_;
  int64_t micro_ = -1, pass_at_ = 0;
  int64_t next_use(ExpertId id) const;  // position of its next pass in the step, or INT64_MAX
  int64_t pass_position(int block, bool backward) const;
  GradientArea grads_;
  std::thread prefetcher_;
  OffloadStats stats_;
  std::vector<uint8_t> changed_;   // [store group]: updated since last_checkpoint_
  std::string last_checkpoint_;    // written or loaded; "" = none to link from
  std::shared_future<void> store_read_;  // a background save reading the records
};

}  // namespace sigma
