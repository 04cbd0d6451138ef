// The seam between an RRE block and wherever its experts live (DESIGN §8). The block computes
// its plan (expert -> rows, a pure function of (group, token id)) and hands it, with the rows,
// to an executor:
//   LocalExperts  the experts are model tensors, or store copies bound by Model::bind_expert;
//   EcssExperts   (src/ecss/) gathers the step's active experts from the expert store, binds
//                 them, and updates them with the store's lazy Adam;
//   ExpertParallel (src/parallel/expert_parallel.h) sends each row to the rank holding its expert,
//                 inside the row's expert group.
// Step hooks let a training step drive the executor without knowing which one it is.
#pragma once
#include <cstdint>
#include <span>
#include <vector>

#include "model/batch.h"
#include "model/rre.h"
#include "model/weights.h"

namespace sigma {

// Buffers of one RRE block's expert pass. pre, act: [N,f] saved for backward, in plan order;
// gx, gy, gdx: [N,d] scratch. Backward overwrites act (ffn_backward).
struct ExpertBuffers {
  float *pre, *act, *gx, *gy, *gdx;
};

class ExpertExecutor {
 public:
  virtual ~ExpertExecutor() = default;

  // y[N,d] += FFN_{expert(i)}(x[i]) for each row i of RRE block `block` (plan p).
  virtual void forward(int block, const RreWeights& w, const RrePlan& p, const ExpertBuffers& b,
                       float* y, const float* x, int64_t N, int64_t d, int64_t f) = 0;
  // Accumulates dx[N,d] and the gradients of every expert that holds rows.
  virtual void backward(int block, const RreWeights& w, const RrePlan& p, const ExpertBuffers& b,
                        float* dx, const float* dy, const float* x, int64_t N, int64_t d,
                        int64_t f) = 0;

  // Whether forward() may run on several threads at once (distinct buffers): true where it
  // keeps no state of its own between calls.
  virtual bool concurrent_forward() const { return false; }

  // Training-step hooks (defaults: experts are ordinary model parameters).
  // Before the step's first forward pass: make every expert the micro-batches route to usable.
  virtual void begin_step(std::span<const Batch> /*micro*/) {}
  // A data-parallel training step: `micro` is the whole global batch, of which this rank runs
  // micro-batches [first, first + count). Default: begin_step over those.
  virtual void begin_global_step(std::span<const Batch> micro, size_t first, size_t count) {
    begin_step(micro.subspan(first, count));
  }
  // Around the forward and backward pass of this rank's micro-batch j (0 .. count-1) of the
  // step. Forward passes outside them are evaluations.
  virtual void begin_micro_batch(size_t /*j*/) {}
  virtual void end_micro_batch() {}
  // Appends the squared-norm pieces of the expert gradients the model's ParamSet does not
  // hold, one per (expert, leaf) in optim/grad_norm.h's order (experts absent here would add
  // exact zeros): the step folds them after the ParamSet's pieces, so the norm is the
  // in-model norm bit for bit.
  virtual void append_grad_sq_parts(std::vector<double>& /*parts*/) const {}
  // Updates those experts (after the dense optimizer step), gradients scaled by grad_scale.
  virtual void update(float /*lr*/, float /*grad_scale*/) {}
};

// Runs each expert on this process over the weights RreWeights points at.
class LocalExperts : public ExpertExecutor {
 public:
  void forward(int block, const RreWeights& w, const RrePlan& p, const ExpertBuffers& b, float* y,
               const float* x, int64_t N, int64_t d, int64_t f) override;
  void backward(int block, const RreWeights& w, const RrePlan& p, const ExpertBuffers& b,
                float* dx, const float* dy, const float* x, int64_t N, int64_t d,
                int64_t f) override;
  bool concurrent_forward() const override { return true; }
};

}  // namespace sigma
