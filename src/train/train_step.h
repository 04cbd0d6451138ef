// One optimizer step (DESIGN §8): batch -> forward -> backward -> reduce_grads(Communicator&)
// -> clip -> update, as separate calls (marian's GraphGroup owns the reduce the same way).
// The step owns no I/O: the run loop (train/trainer.cpp) owns data, checkpoints, metrics and
// evaluation.
#pragma once
#include <functional>
#include <span>
#include <vector>

#include "dist/communicator.h"
#include "model/activations.h"
#include "model/model.h"
#include "optim/adamw.h"

namespace sigma {

// Sums every parameter gradient over the communicator's ranks (identity on one process).
void reduce_grads(Communicator& comm, ParamSet& params);

struct StepResult {
  double grad_norm = 0;  // global L2 norm before clipping (dense and expert gradients)
  float clip = 1.0f;     // the factor gradients were scaled by
  double aux_loss = 0;   // learned gate: weighted load-balancing loss, mean over micro-batches
  double loss = 0;       // the step's mean masked token loss over all ranks
  bool skipped = false;  // non-finite loss or grad_norm: no update applied (train/nonfinite.h)
};

class TrainStep {
 public:
  using LossSink = std::function<void(const Batch&, const std::vector<float>& token_loss)>;
  // The model's expert executor (Model::expert_executor) takes part in every step.
  TrainStep(Model& model, AdamW& opt, Communicator& comm, const OptimConfig& cfg);

  // Makes every expert the micro-batches route to usable (ECSS gathers and binds them). Call
  // before run(); the run loop may start the next step's prefetch in between.
  void prepare(std::span<const Batch> micro);
  // Forward and backward over each micro-batch, each token's loss weighted by its mask over
  // the step's mask total (all ranks); then reduce, mask (frozen parameters, untouched rows),
  // clip to optim.grad_clip and update with learning rate lr. `sink` sees every micro-batch's
  // per-token losses (after backward, before the reduce). A non-finite loss or gradient norm
  // skips the update (StepResult::skipped).
  StepResult run(std::span<const Batch> micro, float lr, const UpdateMask& mask,
                 const LossSink& sink);

 private:
  double mask_total(std::span<const Batch> micro);

  Model& model_;
  AdamW& opt_;
  Communicator& comm_;
  OptimConfig cfg_;
  Activations acts_;
  std::vector<float> token_loss_, weight_;
};

}  // namespace sigma
