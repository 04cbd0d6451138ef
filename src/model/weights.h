// The model's parameter registry (DESIGN §4; the names are built by model/names.h) and the typed
// pointer view that the training model and the KV-cache decoder both read.
#pragma once
#include <string_view>
#include <vector>

#include "kernels/types.h"
#include "model/config.h"
#include "model/ffn.h"
#include "model/params.h"

namespace sigma {

// The weights inference reads (Model::use_weights, `--precision`): fp32, bf16 copies, or int8
// with one fp32 scale per output channel.
enum class WeightFormat : uint8_t { F32, Bf16, Int8 };
const char* weight_format_name(WeightFormat f);            // "fp32", "bf16", "int8"
WeightFormat weight_format_from_name(std::string_view s);  // throws naming the known ones

// Value and gradient pointers of one parameter (tensor buffers never move); for the matrices
// Model::use_weights converts, the copy inference reads instead of v (v is then null): p, fp32
// in panels; h, bf16; or q, int8, with s its scales (one per column; per row for the embedding
// table).
struct PV {
  float* v = nullptr;
  float* g = nullptr;
  const float* p = nullptr;
  const uint16_t* h = nullptr;
  const int8_t* q = nullptr;
  const float* s = nullptr;
  WeightView view() const { return {v, p, h, q, s}; }  // what the forward reads (ffn.h)
};

// The RRE FFN of one block: the experts of every group, concatenated in group order, so group
// g's expert e is expert[offset[g] + e]; table[g] is the routing table R[l][g], int32 [V].
// With the experts in a store (ECSS) the pointers of experts not bound for the step are null.
struct RreWeights {
  std::vector<int> offset;            // [G+1], offset[G] = E
  std::vector<const int32_t*> table;  // [G] (null with a learned gate)
  std::vector<FfnWeights> expert;     // [E] value pointers into blocks.l.rre.<group>.*
  std::vector<FfnGrads> expert_grad;  // [E]
  int experts() const { return offset.empty() ? 0 : offset.back(); }
  // The expert that token `id` of a row in group g goes to.
  int route(int g, int32_t id) const { return offset[size_t(g)] + table[size_t(g)][id]; }
};

struct BlockWeights {
  PV ln1_w, ln1_b, qkv_w, qkv_b, out_w, out_b, ln2_w, ln2_b;
  PV w_in, b_in, w_out, b_out;  // dense FFN (null in an RRE block)
  PV query;                     // query layer only: the learned query table [T, d]
  RreWeights rre;               // expert block only
  std::vector<PV> gate;         // learned-gate baseline: per group, W_g [d, K_g]
  bool is_rre() const { return !rre.expert.empty(); }
  FfnWeights ffn() const {
    return {w_in.view(), b_in.v, w_out.view(), b_out.v};
  }
  FfnGrads ffn_grad() const { return {w_in.g, b_in.g, w_out.g, b_out.g}; }
};

struct ModelWeights {
  PV tokens, positions, lnf_w, lnf_b;
  std::vector<BlockWeights> blocks;
  static ModelWeights bind(ParamSet& ps, const BufferSet& bs, const ModelConfig& cfg);
};


// Adds every parameter of the model to `ps` (zero-initialised), in a fixed order (names from
// model/names.h):
// embed.tokens [S*V,d], embed.positions [T,d], blocks.L.{ln1,attn.qkv,attn.out,ln2}.*,
// blocks.<last>.attn.query_table [T,d], then per block either ffn.{w_in [d,f], b_in [f],
// w_out [f,d], b_out [d]} (dense) or, per group g, rre.g.{w_in [K,d,f], b_in [K,f],
// w_out [K,f,d], b_out [K,d]} (RRE, marked expert) and, with a learned gate,
// gate.g.w [d,K]; final_ln.{w,b}. Without `experts` the rre.* tensors are left out: they live
// in an expert store (ECSS) and the model sees only the ones bound for the current step.
// With tp > 1 the tensors model/tensor_parallel.h splits get this rank's share of the shape.
void register_params(ParamSet& ps, const ModelConfig& cfg, bool experts = true, int tp = 1);

// Adds the routing tables routing.{l}.{g}, int32 [V], for every RRE block l and group g, in
// that order (zero-filled: the model builds or loads them); none with a learned gate.
void register_buffers(BufferSet& bs, const ModelConfig& cfg);

}  // namespace sigma
