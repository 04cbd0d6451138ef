// The PanGu-α decoder (DESIGN §1): slot embeddings + learned positions, L-1 pre-LN blocks,
// the query layer (attention query = a learned table of positions), final LayerNorm, tied head.
// Forward saves every activation backward needs in per-block structs; backward accumulates into
// the ParamSet's gradients.
#pragma once
#include <memory>
#include <vector>

#include "model/batch.h"
#include "model/config.h"
#include "model/params.h"
#include "model/weights.h"

namespace sigma {

class Model {
 public:
  Model(const ModelConfig& cfg, uint64_t seed);
  ~Model();
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  const ModelConfig& config() const { return cfg_; }
  ParamSet& params() { return params_; }
  const ModelWeights& weights() const { return *w_; }
  const ParamSet& params() const { return params_; }

  // Forward pass; token_loss[B*T] receives every position's cross-entropy (masked or not).
  // With grad_scale (per token, [B*T]) it also runs backward, accumulating parameter gradients
  // of sum_i grad_scale[i] * loss[i].
  void forward(const Batch& batch, float* token_loss, const float* grad_scale = nullptr);

  // Logits of the last forward pass, [B*T, V]; only valid when it ran without grad_scale.
  const float* logits() const;

  // FLOPs of one forward+backward per token, by 6*(non-embedding params) + 6*V*d (head) +
  // 12*L*T*d (attention scores and values, causal savings not discounted).
  double train_flops_per_token() const;

 private:
  struct Acts;
  void ensure_workspace(int B, int T);
  void block_forward(int l, const Batch& b);
  void block_backward(int l, const Batch& b, float* dh);
  void head(const Batch& b, float* token_loss, const float* grad_scale);

  ModelConfig cfg_;
  ParamSet params_;
  std::unique_ptr<ModelWeights> w_;
  std::unique_ptr<Acts> a_;
};

}  // namespace sigma
