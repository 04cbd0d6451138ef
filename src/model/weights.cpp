#include "model/weights.h"

#include <fmt/format.h>

#include "model/routing.h"

namespace sigma {

std::string expert_tensor_name(int l, const std::string& group, const char* leaf) {
  return fmt::format("blocks.{}.rre.{}.{}", l, group, leaf);
}

bool is_expert_tensor(const std::string& name) {
  return name.rfind("blocks.", 0) == 0 && name.find(".rre.") != std::string::npos;
}

void register_params(ParamSet& ps, const ModelConfig& cfg, bool experts) {
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
    if (!cfg.is_rre_block(l)) {
      ps.add(b + "ffn.w_in", {d, f}, true);
      ps.add(b + "ffn.b_in", {f}, false);
      ps.add(b + "ffn.w_out", {f, d}, true);
      ps.add(b + "ffn.b_out", {d}, false);
    } else {
      for (const GroupSpec& g : cfg.groups) {
        const int64_t K = g.experts;
        if (experts) {
          ps.add(expert_tensor_name(l, g.name, "w_in"), {K, d, f}, true, true);
          ps.add(expert_tensor_name(l, g.name, "b_in"), {K, f}, false, true);
          ps.add(expert_tensor_name(l, g.name, "w_out"), {K, f, d}, true, true);
          ps.add(expert_tensor_name(l, g.name, "b_out"), {K, d}, false, true);
        }
        if (cfg.gated()) ps.add(b + "gate." + g.name + ".w", {d, K}, true);
      }
    }
  }
  ps.add("final_ln.w", {d}, false);
  ps.add("final_ln.b", {d}, false);
}

void register_buffers(BufferSet& bs, const ModelConfig& cfg) {
  if (cfg.gated()) return;
  for (int l = cfg.first_rre_block(); l < cfg.layers; ++l)
    for (const GroupSpec& g : cfg.groups)
      bs.add(routing_name(l, g.name), DType::I32, {int64_t(cfg.vocab)});
}

ModelWeights ModelWeights::bind(ParamSet& ps, const BufferSet& bs, const ModelConfig& cfg) {
  auto pv = [&](const std::string& name) {
    Param& p = ps.at(name);
    return PV{p.value.f(), p.grad.f()};
  };
  const int64_t d = cfg.d_model, f = cfg.ffn();
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
    if (!cfg.is_rre_block(l)) {
      k.w_in = pv(b + "ffn.w_in");
      k.b_in = pv(b + "ffn.b_in");
      k.w_out = pv(b + "ffn.w_out");
      k.b_out = pv(b + "ffn.b_out");
    } else {
      RreWeights& r = k.rre;
      r.offset.push_back(0);
      for (const GroupSpec& g : cfg.groups) {
        const std::string n = b + "rre." + g.name + ".";
        if (!ps.contains(n + "w_in")) {  // experts in a store: bound step by step
          r.expert.resize(r.expert.size() + size_t(g.experts));
          r.expert_grad.resize(r.expert_grad.size() + size_t(g.experts));
        } else {
          const PV wi = pv(n + "w_in"), bi = pv(n + "b_in"), wo = pv(n + "w_out"), bo = pv(n + "b_out");
          for (int64_t e = 0; e < g.experts; ++e) {
            r.expert.push_back({wi.v + e * d * f, bi.v + e * f, wo.v + e * f * d, bo.v + e * d});
            r.expert_grad.push_back({wi.g + e * d * f, bi.g + e * f, wo.g + e * f * d, bo.g + e * d});
          }
        }
        r.offset.push_back(r.offset.back() + g.experts);
        if (cfg.gated())
          k.gate.push_back(pv(b + "gate." + g.name + ".w"));
        r.table.push_back(cfg.gated() ? nullptr
                                      : bs.at(routing_name(l, g.name)).value.data<int32_t>());
      }
    }
    w.blocks.push_back(k);
  }
  return w;
}

}  // namespace sigma
