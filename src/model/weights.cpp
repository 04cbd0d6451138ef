#include "model/weights.h"

#include <fmt/format.h>

namespace sigma {

void register_params(ParamSet& ps, const ModelConfig& cfg) {
  const int64_t V = cfg.vocab, d = cfg.d_model, f = cfg.ffn(), T = cfg.context;
  const int L = cfg.layers;
  ps.add("embed.tokens", {int64_t(cfg.slots) * V, d}, false);
  ps.add("embed.positions", {T, d}, false);
  for (int l = 0; l < L; ++l) {
    const std::string b = fmt::format("blocks.{}.", l);
    ps.add(b + "ln1.w", {d}, false);
    ps.add(b + "ln1.b", {d}, false);
    ps.add(b + "attn.qkv.w", {d, 3 * d}, true);
    ps.add(b + "attn.qkv.b", {3 * d}, false);
    ps.add(b + "attn.out.w", {d, d}, true);
    ps.add(b + "attn.out.b", {d}, false);
    if (l == L - 1) ps.add(b + "attn.query_table", {T, d}, false);
    ps.add(b + "ln2.w", {d}, false);
    ps.add(b + "ln2.b", {d}, false);
    ps.add(b + "ffn.w_in", {d, f}, true);
    ps.add(b + "ffn.b_in", {f}, false);
    ps.add(b + "ffn.w_out", {f, d}, true);
    ps.add(b + "ffn.b_out", {d}, false);
  }
  ps.add("final_ln.w", {d}, false);
  ps.add("final_ln.b", {d}, false);
}

ModelWeights ModelWeights::bind(ParamSet& ps, const ModelConfig& cfg) {
  auto pv = [&](const std::string& name) {
    Param& p = ps.at(name);
    return PV{p.value.f(), p.grad.f()};
  };
  ModelWeights w;
  w.tokens = pv("embed.tokens");
  w.positions = pv("embed.positions");
  w.lnf_w = pv("final_ln.w");
  w.lnf_b = pv("final_ln.b");
  for (int l = 0; l < cfg.layers; ++l) {
    const std::string b = fmt::format("blocks.{}.", l);
    BlockWeights k;
    k.ln1_w = pv(b + "ln1.w");
    k.ln1_b = pv(b + "ln1.b");
    k.qkv_w = pv(b + "attn.qkv.w");
    k.qkv_b = pv(b + "attn.qkv.b");
    k.out_w = pv(b + "attn.out.w");
    k.out_b = pv(b + "attn.out.b");
    if (l == cfg.layers - 1) k.query = pv(b + "attn.query_table");
    k.ln2_w = pv(b + "ln2.w");
    k.ln2_b = pv(b + "ln2.b");
    k.w_in = pv(b + "ffn.w_in");
    k.b_in = pv(b + "ffn.b_in");
    k.w_out = pv(b + "ffn.w_out");
    k.b_out = pv(b + "ffn.b_out");
    w.blocks.push_back(k);
  }
  return w;
}

}  // namespace sigma
