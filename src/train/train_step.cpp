#include "train/train_step.h"

#include <cmath>

#include "optim/grad_norm.h"
#include "train/nonfinite.h"

namespace sigma {

void reduce_grads(Communicator& comm, ParamSet& params) {
  if (comm.size() == 1) return;
  for (Param& p : params.all()) comm.all_reduce_sum(p.grad.f(), p.grad.numel());
}

TrainStep::TrainStep(Model& model, AdamW& opt, Communicator& comm, const OptimConfig& cfg)
    : model_(model), opt_(opt), comm_(comm), cfg_(cfg) {}

void TrainStep::prepare(std::span<const Batch> micro) {
  model_.expert_executor().begin_step(micro);
}

double TrainStep::mask_total(std::span<const Batch> micro) {
  double total = 0;
  for (const Batch& b : micro)
    for (float x : b.mask) total += x;
  comm_.all_reduce_sum(&total, 1);
  return total;
}

StepResult TrainStep::run(std::span<const Batch> micro, float lr, const UpdateMask& mask,
                          const LossSink& sink) {
  const double total = mask_total(micro);
  StepResult r;
  model_.params().zero_grad();
  for (const Batch& b : micro) {
    const size_t n = b.mask.size();
    token_loss_.resize(n);
    weight_.resize(n);
    for (size_t i = 0; i < n; ++i) weight_[i] = total > 0 ? float(b.mask[i] / total) : 0.0f;
    model_.forward(b, acts_, token_loss_.data(), weight_.data());
    model_.backward(b, acts_);
    for (size_t i = 0; i < n; ++i)
      if (weight_[i] != 0.0f) r.loss += double(token_loss_[i]) * weight_[i];
    if (sink) sink(b, token_loss_);
    r.aux_loss += model_.aux_loss() / double(micro.size());
  }
  comm_.all_reduce_sum(&r.loss, 1);
  reduce_grads(comm_, model_.params());
  if (!mask.all()) mask.mask_grads(model_.params());
  ExpertExecutor& experts = model_.expert_executor();
  r.grad_norm = std::sqrt(grad_sq(model_.params()) + experts.grad_sq());
  r.clip = (cfg_.grad_clip > 0 && r.grad_norm > cfg_.grad_clip) ? float(cfg_.grad_clip / r.grad_norm)
                                                                 : 1.0f;
  // Non-finite guard: decided on reduced values, so every rank skips alike.
  r.skipped = !finite_step(r.loss, r.grad_norm);
  if (r.skipped) return r;
  opt_.step(model_.params(), lr, r.clip, &mask);
  experts.update(lr, r.clip);
  return r;
}

}  // namespace sigma
