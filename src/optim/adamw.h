// AdamW with per-parameter step counts and per-group epsilon (hybrid Adam, DESIGN §3):
// expert tensors use eps_rre, everything else eps; weight decay only on linear weights. The
// update itself is ops::adam_step (kernels/ops.h), the one Adam kernel, which the ECSS expert
// store also runs: experts train bit for bit alike in the model and in the store.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/options.h"
#include "core/tensor.h"
#include "kernels/types.h"
#include "model/params.h"

namespace sigma {

struct OptimConfig {
  float lr = 3e-3f;
  float min_lr_ratio = 0.1f;  // cosine decays to lr * min_lr_ratio
  int64_t warmup = 100;       // linear warm-up steps
  int64_t schedule_steps = 0;  // steps the warm-up + cosine spans (0 = train.steps)
  float beta1 = 0.9f, beta2 = 0.95f;
  float eps = 1e-8f;
  float eps_rre = 1e-10f;
  float weight_decay = 0.1f;
  float grad_clip = 1.0f;  // global-norm clipping; 0 disables
  bool sparse_embeddings = false;  // update only the batch's embed.tokens rows (lazy, per row)
  void describe(Options& o, const std::string& prefix);
};

// Learning rate at `step` (0-based) of `total` (c.schedule_steps instead when set): linear
// warm-up, then cosine to the floor, which it keeps past the end.
float lr_at(const OptimConfig& c, int64_t step, int64_t total);

// Which parameters a step updates (train.freeze): by default all. A frozen parameter keeps its
// values, moments and step; a parameter limited to row ranges (an embedding table's slots)
// updates only those rows, with the tensor's step count.
struct UpdateMask {
  std::vector<uint8_t> frozen;  // [params]; empty = none
  std::vector<std::vector<std::pair<int64_t, int64_t>>> rows;  // [params]; empty = every row
  // [params]; a row-limited parameter with lazy_rows keeps a step count per row, advanced only
  // when the row is updated (sparse embedding updates: the rows of the batch's tokens).
  std::vector<uint8_t> lazy_rows;
  bool all() const { return frozen.empty() && rows.empty(); }
  // Zeroes the gradients that will not be applied, so that the norm (and clipping) sees only
  // what trains.
  void mask_grads(ParamSet& params) const;
};

class AdamW {
 public:
  // `owned` (ZeRO, parallel/shard_plan.h): [params], the elements of each (whole rows, or
  // nothing) this rank keeps state for and updates; empty = all of every one.
  AdamW(const OptimConfig& cfg, const ParamSet& params, std::vector<ParamPiece> owned = {});

  // Updates every owned parameter (those `mask` allows) with learning rate `lr`; gradients
  // scaled by grad_scale first.
  void step(ParamSet& params, float lr, float grad_scale, const UpdateMask* mask = nullptr);

  // m and v cover the owned rows only: [rows owned, ...] of the parameter's shape.
  struct State {
    Tensor m, v;
    int64_t step = 0;
    std::vector<int64_t> row_step;  // lazy row updates only: per owned row (empty until used)
  };
  std::vector<State>& state() { return state_; }  // parallel to params.all()
  const std::vector<State>& state() const { return state_; }
  bool owns(size_t i) const { return owned_.empty() || owned_[i].size() > 0; }
  // The elements of param i this optimizer updates (its rows from first_row(i) on).
  ParamPiece owned(size_t i) const { return owned_.empty() ? whole_[i] : owned_[i]; }
  // True when param i is updated only in part here (another rank owns the rest).
  bool owns_part(size_t i) const { return owns(i) && owned(i).size() < whole_[i].size(); }
  int64_t first_row(size_t i) const;

 private:
  void lazy_row_step(size_t i, Param& p, State& s,
                     const std::vector<std::pair<int64_t, int64_t>>& ranges, float lr, float eps,
                     float grad_scale);
  // The kernel's arguments for parameter p at its update number `step`.
  AdamStepArgs args(const Param& p, float lr, float eps, float grad_scale, int64_t step) const;
  OptimConfig cfg_;
  std::vector<State> state_;
  std::vector<ParamPiece> owned_, whole_;
  std::vector<int64_t> width_;  // [params]: elements a row
};

}  // namespace sigma
