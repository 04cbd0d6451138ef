// The dense model's parameter names (DESIGN §4) in one place: registration and the typed
// pointer view that the training model and the KV-cache decoder both read.
#pragma once
#include <vector>

#include "model/config.h"
#include "model/ffn.h"
#include "model/params.h"

namespace sigma {

// Value and gradient pointers of one parameter (tensor buffers never move).
struct PV {
  float* v = nullptr;
  float* g = nullptr;
};

struct BlockWeights {
  PV ln1_w, ln1_b, qkv_w, qkv_b, out_w, out_b, ln2_w, ln2_b, w_in, b_in, w_out, b_out;
  PV query;  // query layer only: the learned query table [T, d]
  FfnWeights ffn() const { return {w_in.v, b_in.v, w_out.v, b_out.v}; }
  FfnGrads ffn_grad() const { return {w_in.g, b_in.g, w_out.g, b_out.g}; }
};

struct ModelWeights {
  PV tokens, positions, lnf_w, lnf_b;
  std::vector<BlockWeights> blocks;
  static ModelWeights bind(ParamSet& ps, const ModelConfig& cfg);
};

// Adds every parameter of the model to `ps` (zero-initialised), in a fixed order:
// embed.tokens [S*V,d], embed.positions [T,d], blocks.L.{ln1,attn.qkv,attn.out,ln2,ffn}.*,
// blocks.<last>.attn.query_table [T,d], final_ln.{w,b}.
void register_params(ParamSet& ps, const ModelConfig& cfg);

}  // namespace sigma
