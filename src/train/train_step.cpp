#include "train/train_step.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string_view>
#include <iterator>

#include "core/error.h"
#include "kernels/ops.h"
#include "model/names.h"
#include "optim/grad_norm.h"
#include "train/nonfinite.h"

namespace sigma {

namespace {

// Sums the gradients of successive micro-batches in tree_sum's order (dist/communicator.h),
// so that the ranks' block sums combine to the one-process sum bit for bit: a binary counter
// of partial sums (TreeAccumulator's), held on the device and added with ops::add_into (one
// fp32 addition per element, the same as TreeAccumulator's). Only the ParamSet's: an expert
// executor that keeps gradients of its own sums them itself.
class GradTree {
 public:
  void push(const ParamSet& ps) {
    Tensor leaf = ops::empty(DType::F32, {ps.numel()});
    int64_t at = 0;
    for (const Param& p : ps.all()) {
      ops::copy(leaf.dev_f() + at, p.grad.dev_f(), p.grad.numel());
      at += p.grad.numel();
    }
    stack_.push_back({0, std::move(leaf)});
    while (stack_.size() >= 2 && stack_[stack_.size() - 2].first == stack_.back().first) {
      Tensor right = std::move(stack_.back().second);
      stack_.pop_back();
      ops::add_into(stack_.back().second.dev_f(), right.dev_f(), right.numel());
      stack_.back().first += 1;
    }
  }
  // dist.overlap: the gradients of `pieces`, the current micro-batch's (the last leaf, not
  // pushed), become the tree's total over every leaf: the same additions as push() then
  // finish() (each carry of push and each step of finish adds the partial sum below to the
  // total above, so both walk the stack from the top), for these pieces' elements only.
  void fold_last_into(ParamSet& ps, const ParamStage& pieces) {
    if (stack_.empty()) return;
    if (offset_.size() != ps.all().size()) {
      offset_.assign(ps.all().size(), 0);
      int64_t at = 0;
      for (size_t i = 0; i < offset_.size(); ++i) offset_[i] = at, at += ps.all()[i].grad.numel();
    }
    for (const ParamPiece& piece : pieces) {
      float* grad = ps.all()[piece.param].grad.dev_f() + piece.begin;
      const int64_t n = piece.size(), at = offset_[piece.param] + piece.begin;
      const float* cur = grad;
      for (size_t k = stack_.size(); k-- > 0;) {
        ops::add_into(stack_[k].second.dev_f() + at, cur, n);
        cur = stack_[k].second.dev_f() + at;
      }
      ops::copy(grad, cur, n);
    }
  }
  void clear() { stack_.clear(); }
  // Writes the total into the gradients and empties the tree.
  void finish(ParamSet& ps) {
    SIGMA_CHECK(!stack_.empty(), "GradTree: no leaf");
    Tensor total = std::move(stack_.back().second);
    for (size_t i = stack_.size() - 1; i-- > 0;) {  // S1 + (S2 + (... + Sm))
      ops::add_into(stack_[i].second.dev_f(), total.dev_f(), total.numel());
      std::swap(total, stack_[i].second);
    }
    stack_.clear();
    int64_t at = 0;
    for (Param& p : ps.all()) {
      ops::copy(p.grad.dev_f(), total.dev_f() + at, p.grad.numel());
      at += p.grad.numel();
    }
  }

 private:
  std::vector<std::pair<int, Tensor>> stack_;  // (level, partial sum) on the device
  std::vector<int64_t> offset_;                 // [param]: its first element in a leaf
};

bool power_of_two(size_t k) { return k && !(k & (k - 1)); }

// The progress strategy of the overlapped exchanges: a test of what is in flight at each layer
// boundary, unless SIGMA_OVERLAP_POLL=0 (benchmarks measure what the tests are worth: without
// them, Open MPI advances the exchanges only inside other MPI calls and the final waits).
bool overlap_polls() {
  static const bool on = [] {
    const char* v = std::getenv("SIGMA_OVERLAP_POLL");
    return !(v && std::string_view(v) == "0");
  }();
  return on;
}

}  // namespace

TrainStep::TrainStep(Model& model, AdamW& opt, Communicator& comm, const OptimConfig& cfg,
                     ShardPlan plan)
    : model_(model), opt_(opt), comm_(comm), cfg_(cfg), plan_(std::move(plan)) {
  SIGMA_CHECK(plan_.ranks == comm_.size(), "shard plan for {} ranks, communicator of {}",
              plan_.ranks, comm_.size());
  owned_ = plan_.owned_by(comm_.rank());
  const size_t S = model_.param_stages().size(), L = size_t(model_.config().layers);
  // A model built with only this rank's values (sharded construction, Model::InitOnly) holds
  // no stage whole yet: the first read of each gathers it.
  const std::vector<ParamPiece>& built = model_.initialised_only();
  const bool same_plan = std::equal(built.begin(), built.end(), owned_.begin(), owned_.end(),
                                    [](const ParamPiece& a, const ParamPiece& b) {
                                      return a.size() == b.size() && (a.size() == 0 || a.begin == b.begin);
                                    });
  SIGMA_CHECK(built.empty() || same_plan, "the model was initialised for another shard plan than "
              "this step's (rank {} of {})", comm_.rank(), comm_.size());
  held_.assign(S, built.empty() ? 1 : 0);
  pending_.assign(S, 0);
  // Forward: the embeddings, each block (then its expert groups), the final LN, the tied head;
  // backward: the head, then each block (then its groups) top down.
  // (The order only steers the prefetch: a stage asked for out of it is gathered when asked.)
  auto block = [&](size_t l) {
    order_.push_back(l);
    for (size_t s : model_.expert_stages(int(l))) order_.push_back(s);
  };
  order_.push_back(L + 1);
  for (size_t l = 0; l < L; ++l) block(l);
  order_.push_back(L);
  head_at_ = order_.size();
  order_.insert(order_.end(), {L + 1, L, L + 1});
  for (size_t l = L; l-- > 0;) {
    block(l);
    // train.remat = blocks reruns block l's forward (its groups once) before its backward
    // (the groups again); the last block is not rerun.
    if (model_.remat() == Remat::Blocks && l + 1 < L)
      for (size_t s : model_.expert_stages(int(l))) order_.push_back(s);
  }
}

// Every stage in backward's order of finishing: the final LN, each block's groups then the
// block top down, the embeddings (the order the stages' reductions start in).
std::vector<size_t> TrainStep::backward_stages() const {
  const size_t L = size_t(model_.config().layers);
  std::vector<size_t> out{L};
  for (size_t l = L; l-- > 0;) {
    for (size_t s : model_.expert_stages(int(l))) out.push_back(s);
    out.push_back(l);
  }
  out.push_back(L + 1);
  return out;
}

void TrainStep::release_others(Tensor& t, const ParamPiece& p) const {
  std::vector<ParamPiece> others;
  add_outside(others, p, owned_[p.param]);
  for (const ParamPiece& o : others) ops::zero_release(t, o.begin, o.end);
}

void TrainStep::release_stage(size_t s) {
  for (const ParamPiece& p : model_.param_stages()[s])
    release_others(model_.params().all()[p.param].value, p);
  held_[s] = 0;
}

// Stage s is about to be read: its values are completed (a gather in flight) or gathered now;
// with dist.overlap, the gather of the next stage not held is started (prefetch) when the
// passes ask in the expected order (in bf16 the forward asks for every stage at once first).
void TrainStep::need_stage(size_t s) {
  const auto& stages = model_.param_stages();
  if (!held_[s]) {
    if (pending_[s])
      zo_->finish_gather(int(s));
    else
      gather_from_owners(comm_, plan_, model_.params(), zero_bucket(), &stages[s]);
    held_[s] = 1;
    pending_[s] = 0;
    int64_t experts = 0;  // the other ranks' expert values held now
    for (size_t t = 0; t < stages.size(); ++t) {
      if (!held_[t]) continue;
      for (const ParamPiece& p : stages[t])
        if (model_.params().all()[p.param].expert) experts += p.size() - p.overlap(owned_[p.param]);
    }
    peak_experts_ = std::max(peak_experts_, experts);
  }
  if (!zo_ || at_ >= order_.size() || order_[at_] != s) return;
  ++at_;
  for (size_t k = at_; k < order_.size() && k < at_ + 2; ++k) {
    const size_t t = order_[k];
    if (t == s || held_[t]) continue;
    if (!pending_[t]) zo_->start_gather(stages[t], int(t));
    pending_[t] = 1;
    break;
  }
}

// Stage s was read for the last time in this pass. The last block is kept from its forward to
// its backward, which reads it next.
void TrainStep::done_stage(size_t s) {
  const size_t L = size_t(model_.config().layers);
  if (!in_backward_ && L > 0 && s == L - 1) return;
  release_stage(s);
}

void TrainStep::check_split(size_t micro) const {
  const size_t R = size_t(comm_.size());
  SIGMA_CHECK(micro % R == 0 && (R == 1 || power_of_two(micro / R)),
              "{} ranks cannot share {} micro-batches per step: train.accum must be the number "
              "of ranks times a power of two (each rank runs an aligned block of the step's "
              "micro-batches, which keeps every rank count bit-identical)", R, micro);
}

std::span<const Batch> TrainStep::local(std::span<const Batch> micro) const {
  check_split(micro.size());
  const size_t k = micro.size() / size_t(comm_.size());
  return micro.subspan(size_t(comm_.rank()) * k, k);
}

void TrainStep::prepare(std::span<const Batch> micro) {
  const size_t k = local(micro).size();
  model_.expert_executor().begin_global_step(micro, size_t(comm_.rank()) * k, k);
}

// per_slot[slot * (2D + 2) ...]: D loss sums, D token counts, the learned gate's aux loss, and
// the loss weighted as the gradient weights it (the step's loss; NaN if a weight is).
void TrainStep::sum_losses(const Batch& b, size_t slot, std::vector<double>& per_slot) const {
  const size_t D = size_t(model_.config().domains.size());
  double* s = per_slot.data() + slot * (2 * D + 2);
  for (int r = 0; r < b.B; ++r)
    for (int t = 0; t < b.T; ++t) {
      const size_t i = size_t(r) * size_t(b.T) + size_t(t);
      if (b.mask[i] == 0.0f) continue;
      s[b.domain[size_t(r)]] += token_loss_[i];
      s[D + size_t(b.domain[size_t(r)])] += 1;
    }
  s[2 * D] = model_.aux_loss();
  for (size_t i = 0; i < token_loss_.size(); ++i)
    if (weight_[i] != 0.0f) s[2 * D + 1] += double(token_loss_[i]) * weight_[i];
}

// The norm's pieces over the tp group: a split tensor's piece is the sum of its slices' (added
// in rank order: the same bits on every rank of the group), a replicated tensor's comes from
// tp rank 0 alone. The pieces are grad_sq_parts' (each tensor's slabs), then the executor's:
// per (expert, leaf) in kExpertLeaves order, each leaf split as tp_expert_leaf_split says
// (b_out replicated).
void TrainStep::tp_norm_parts(std::vector<double>& parts) const {
  if (tp_->rank() != 0) {
    size_t j = 0;
    for (const Param& p : model_.params().all()) {
      if (p.expert && p.grad.shape().size() >= 2) continue;  // grad_sq_parts' expert pieces
      const bool replicated = tp_split(model_.config(), p.name).replicated();
      for (int64_t k = norm_slabs(p, plan_.slab); k-- > 0; ++j)
        if (replicated) parts[j] = 0.0;
    }
    constexpr size_t leaves = std::size(names::kExpertLeaves);
    for (size_t i = j; i < parts.size(); ++i)
      if (tp_expert_leaf_split((i - j) % leaves).replicated()) parts[i] = 0.0;
  }
  tp_->all_reduce_sum(parts.data(), parts.size());
}

size_t TrainStep::overlap_bound() const {
  if (max_in_flight_ > 0) return max_in_flight_;
  // ZeRO-1 and 2: 8 buckets' worth, sized for throughput on a slow link (issue 38's notes:
  // 2 buckets cost 2-6 % of the step at 1 Gbit/s and save ~110 MiB a rank at d = 512, R = 4;
  // dist.overlap_mib lets a user make that trade).
  if (!zero3()) return 8 * kZeroBucketElements;
  // ZeRO-3 holds a stage or two of the others' values; the exchange buffers in flight (each
  // round's packed copy and what it receives) are kept to about one round of the largest stage
  // (at most a bucket's) on top: with 8 buckets' worth they were the largest part of the peak
  // above the shard (issue 38).
  size_t stage = 0;
  for (const ParamStage& pieces : model_.param_stages()) {
    size_t n = 0;
    for (const ParamPiece& p : pieces) n += size_t(p.size());
    stage = std::max(stage, n);
  }
  return 2 * std::min(stage, zero_bucket());
}

StepResult TrainStep::run(std::span<const Batch> micro, float lr, const UpdateMask& mask) {
  SIGMA_CHECK(model_.initialised_only().empty() || zero3(), "a model holding only this rank's "
              "values (sharded construction) trains with dist.zero = 3 only, not {}", zero_);
  const std::span<const Batch> mine = local(micro);
  const size_t first = size_t(comm_.rank()) * mine.size();
  double total = 0;  // every rank sees the whole batch: no exchange needed
  for (const Batch& b : micro)
    for (float x : b.mask) total += x;
  ExpertExecutor& experts = model_.expert_executor();
  const size_t D = size_t(model_.config().domains.size());
  std::vector<double> per_slot(micro.size() * (2 * D + 2), 0.0);
  GradTree tree;
  ParamSet& ps = model_.params();
  const bool zero2 = zero_ >= 2 && comm_.size() > 1, early = zero2 && mine.size() == 1;
  const bool z3 = zero3();
  auto release_other_grads = [&](const ParamStage& pieces) {  // ZeRO-2: keep only my elements'
    for (const ParamPiece& p : pieces) release_others(ps.all()[p.param].grad, p);
  };
  ParamStage every;
  for (size_t i = 0; i < ps.all().size(); ++i) every.push_back(whole_param(ps, i));
  struct Unhook {  // the hooks hold references into this call
    Model& m;
    ~Unhook() {
      m.set_grads_done({});
      m.set_params_needed({});
      m.set_params_done({});
    }
  } unhook{model_};
  // dist.overlap (set_overlap): the exchanges in flight advance at each layer boundary.
  // With a fault-injection hook, which may change the gradients after backward, the stages
  // go after it, in the same order: every rank starts the same exchanges either way.
  const bool ov = overlap_ && comm_.size() > 1, ov_early = ov && !after_backward_;
  if (ov && !zo_) zo_ = std::make_unique<ZeroOverlap>(comm_, plan_, ps, zero_bucket(), overlap_bound());
  if (!ov && zo_) zo_->finish_gathers();
  if (z3) {  // settle() may have gathered every value: back to this rank's own
    if (zo_) zo_->finish_gathers();
    std::fill(pending_.begin(), pending_.end(), 0);
    for (size_t s = 0; s < held_.size(); ++s)
      if (held_[s]) release_stage(s);
    model_.set_params_needed([&](size_t stage) {
      need_stage(stage);
      if (ov && overlap_polls()) zo_->progress();
    });
    model_.set_params_done([&](size_t stage) { done_stage(stage); });
  }
  size_t at_micro = 0;  // the micro-batch being run
  auto reduce_stage = [&](const ParamStage& pieces) {  // final gradients: to their owners
    if (mine.size() > 1) tree.fold_last_into(ps, pieces);
    zo_->start_reduce(pieces);
    if (zero2) release_other_grads(pieces);  // packed already
  };
  if (ov) {
    if (!z3)
      model_.set_params_needed([&](size_t stage) {  // the last step's deferred gather
        zo_->finish_gather(int(stage));
        if (overlap_polls()) zo_->progress();
      });
    model_.set_grads_done([&](const ParamStage& pieces) {
      if (ov_early && at_micro + 1 == mine.size()) reduce_stage(pieces);
      if (overlap_polls()) zo_->progress();
    });
  } else if (early)
    model_.set_grads_done([&](const ParamStage& pieces) {
      reduce_to_owners(comm_, plan_, ps, zero_bucket(), &pieces);
      release_other_grads(pieces);
    });
  for (size_t j = 0; j < mine.size(); ++j) {
    const Batch& b = mine[j];
    at_micro = j;
    if (j == 0 || mine.size() > 1) {
      if (zero2)
        for (Param& p : ps.all()) ops::zero_release(p.grad);
      else
        ps.zero_grad();
    }
    const size_t n = b.mask.size();
    token_loss_.resize(n);
    weight_.resize(n);
    for (size_t i = 0; i < n; ++i) weight_[i] = total > 0 ? float(b.mask[i] / total) : 0.0f;
    experts.begin_micro_batch(j);
    at_ = 0;
    in_backward_ = false;
    model_.forward(b, acts_, token_loss_.data(), weight_.data());
    in_backward_ = true;
    model_.backward(b, acts_);
    in_backward_ = false;
    experts.end_micro_batch();
    sum_losses(b, first + j, per_slot);
    if (after_backward_) after_backward_(model_.params());
    if (ov && !ov_early && j + 1 == mine.size())  // backward's order: final LN, blocks, embeddings
      for (size_t s : backward_stages()) reduce_stage(model_.param_stages()[s]);
    if (mine.size() > 1 && !(ov && j + 1 == mine.size())) tree.push(model_.params());
  }
  if (mine.size() > 1) {
    if (ov)
      tree.clear();  // folded stage by stage into the gradients
    else
      tree.finish(model_.params());
  }
  StepResult r;
  comm_.all_reduce_sum(per_slot.data(), int64_t(per_slot.size()));  // one rank's slots each: exact
  r.domain_loss.assign(D, 0.0);
  r.domain_tokens.assign(D, 0);
  for (size_t s = 0; s < micro.size(); ++s) {
    const double* v = per_slot.data() + s * (2 * D + 2);
    for (size_t d = 0; d < D; ++d) {
      r.domain_loss[d] += v[d];
      r.domain_tokens[d] += int64_t(v[D + d]);
    }
    r.aux_loss += v[2 * D] / double(micro.size());
    r.loss += v[2 * D + 1];
  }
  if (ov)
    zo_->finish_reduce();
  else if (!early)
    reduce_to_owners(comm_, plan_, ps);
  if (zero2 && !early && !ov) release_other_grads(every);
  if (!mask.all()) mask.mask_grads(model_.params());
  std::vector<double> parts = grad_sq_parts(
      model_.params(), comm_.size() > 1 ? owned_ : std::vector<ParamPiece>{}, plan_.slab);
  experts.append_grad_sq_parts(parts);
  if (tp_) tp_norm_parts(parts);
  comm_.all_reduce_sum(parts.data(), int64_t(parts.size()));  // one owner per piece: exact
  r.grad_norm = std::sqrt(fold(parts));
  r.clip = (cfg_.grad_clip > 0 && r.grad_norm > cfg_.grad_clip) ? float(cfg_.grad_clip / r.grad_norm)
                                                                 : 1.0f;
  // Non-finite guard: decided on reduced values, so every rank skips alike.
  r.skipped = !finite_step(r.loss, r.grad_norm);
  if (r.skipped) return r;
  opt_.step(model_.params(), lr, r.clip, &mask);
  if (z3) {  // each rank's own values are updated; the others' are gathered where read
    // Its gradients are read by nothing before the next backward writes them: released
    // (most of them are not written again until late in that backward).
    for (Param& p : ps.all()) ops::zero_release(p.grad);
    experts.update(lr, r.clip);
    return r;
  }
  if (!ov) {
    experts.update(lr, r.clip);
    gather_from_owners(comm_, plan_, model_.params());
    return r;
  }
  // In the order the next forward reads them: the embeddings, the blocks (each with its
  // groups), the final LayerNorm.
  const auto& stages = model_.param_stages();
  for (size_t k = 0; k < head_at_; ++k) zo_->start_gather(stages[order_[k]], int(order_[k]));
  experts.update(lr, r.clip);
  if (!defer_) zo_->finish_gathers();
  return r;
}

void TrainStep::settle_owned() {
  if (!zero3()) return settle();
  if (zo_) zo_->finish_gathers();  // prefetches only: their stages are released below
  std::fill(pending_.begin(), pending_.end(), 0);
  for (size_t s = 0; s < held_.size(); ++s)
    if (held_[s]) release_stage(s);
}

void TrainStep::values_written() {
  if (!zero3()) return;
  std::fill(held_.begin(), held_.end(), 1);
  settle_owned();
}

void TrainStep::forward_only(const std::function<void(Activations&)>& passes) {
  if (!zero3()) {
    settle();
    passes(acts_);
    return;
  }
  settle_owned();
  struct Unhook {
    Model& m;
    TrainStep& t;
    ~Unhook() {
      m.set_params_needed({});
      m.set_params_done({});
      t.settle_owned();  // back to this rank's own values, nothing in flight
    }
  } unhook{model_, *this};
  const size_t L = size_t(model_.config().layers);
  const bool polls = zo_ && overlap_polls();
  at_ = 0;
  // The forward's stages are order_'s first head_at_; a forward starts with the embeddings
  // (L + 1) anywhere but at the tied head (order_[head_at_]), where the prefetch restarts.
  model_.set_params_needed([&, L](size_t stage) {
    if (stage == L + 1 && at_ != head_at_) at_ = 0;
    need_stage(stage);
    if (polls) zo_->progress();
  });
  model_.set_params_done([&](size_t stage) { release_stage(stage); });
  passes(acts_);
}

void TrainStep::settle() {
  if (zo_) zo_->finish_gathers();
  if (!zero3() || std::all_of(held_.begin(), held_.end(), [](uint8_t h) { return h != 0; }))
    return;
  std::fill(pending_.begin(), pending_.end(), 0);
  gather_from_owners(comm_, plan_, model_.params());  // the held stages get their own bits again
  std::fill(held_.begin(), held_.end(), 1);
}

}  // namespace sigma
