#include "model/weights.h"

#include "kernels/ops.h"
#include "model/names.h"
#include "model/tensor_parallel.h"

namespace sigma {

namespace {

// One FFN's tensors (the dense FFN, or one expert) in names::kExpertLeaves order.
struct FfnLeaf {
  const char* name;
  Shape shape;
  bool decay;  // linear weights decay, biases do not
};
std::vector<FfnLeaf> ffn_leaves(int64_t d, int64_t f) {
  return {{names::kWIn, {d, f}, true}, {names::kBIn, {f}, false},
          {names::kWOut, {f, d}, true}, {names::kBOut, {d}, false}};
}

}  // namespace

const char* weight_format_name(WeightFormat f) {
  switch (f) {
    case WeightFormat::F32: return "fp32";
    case WeightFormat::Bf16: return "bf16";
    case WeightFormat::Int8: return "int8";
  }
  return "?";
}

WeightFormat weight_format_from_name(std::string_view s) {
  for (WeightFormat f : {WeightFormat::F32, WeightFormat::Bf16, WeightFormat::Int8})
    if (s == weight_format_name(f)) return f;
  fail("unknown weight precision '{}' (known: fp32, bf16, int8)", s);
}

void register_params(ParamSet& ps, const ModelConfig& cfg, bool experts, int tp) {
  struct Local {  // registers the shape this rank holds of a tensor split over tp ranks
    ParamSet& ps;
    const ModelConfig& cfg;
    int tp;
    void add(const std::string& name, const Shape& full, bool decay) {
      ps.add(name, tp_local_shape(full, tp_split(cfg, name), tp), decay);
    }
  } local{ps, cfg, tp};
  const int64_t V = cfg.vocab, d = cfg.d_model, f = cfg.ffn(), T = cfg.context;
  const int L = cfg.layers;
  local.add(names::kTokens, {int64_t(cfg.slots) * V, d}, false);
  ps.add(names::kPositions, {T, d}, false);
  for (int l = 0; l < L; ++l) {
    ps.add(names::block(l, "ln1.w"), {d}, false);
    ps.add(names::block(l, "ln1.b"), {d}, false);
    local.add(names::block(l, "attn.qkv.w"), {d, 3 * d}, true);
    local.add(names::block(l, "attn.qkv.b"), {3 * d}, false);
    local.add(names::block(l, "attn.out.w"), {d, d}, true);
    ps.add(names::block(l, "attn.out.b"), {d}, false);
    if (l == L - 1) ps.add(names::block(l, "attn.query_table"), {T, d}, false);
    ps.add(names::block(l, "ln2.w"), {d}, false);
    ps.add(names::block(l, "ln2.b"), {d}, false);
    if (!cfg.is_rre_block(l)) {
      for (const FfnLeaf& t : ffn_leaves(d, f)) local.add(names::ffn(l, t.name), t.shape, t.decay);
      continue;
    }
    for (const GroupSpec& g : cfg.groups) {
      const int64_t K = g.experts;
      for (const FfnLeaf& t : experts ? ffn_leaves(d, f) : std::vector<FfnLeaf>{}) {
        Shape stacked{K};  // [K, ...]
        stacked.insert(stacked.end(), t.shape.begin(), t.shape.end());
        const std::string name = names::expert(l, g.name, t.name);
        ps.add(name, tp_local_shape(stacked, tp_split(cfg, name), tp), t.decay, true);
      }
      if (cfg.gated()) ps.add(names::gate(l, g.name), {d, K}, true);
    }
  }
  ps.add(names::kFinalLnW, {d}, false);
  ps.add(names::kFinalLnB, {d}, false);
}

void register_buffers(BufferSet& bs, const ModelConfig& cfg) {
  if (cfg.gated()) return;
  for (int l = cfg.first_rre_block(); l < cfg.layers; ++l)
    for (const GroupSpec& g : cfg.groups)
      bs.add(names::routing(l, g.name), DType::I32, {int64_t(cfg.vocab)});
}

namespace {

PV pv(ParamSet& ps, const std::string& name) {
  Param& p = ps.at(name);
  return PV{p.value.dev_f(), p.grad.dev_f()};
}

// Block l's experts, routing tables and gates, group by group.
RreWeights bind_rre(ParamSet& ps, const BufferSet& bs, const ModelConfig& cfg, int l,
                    std::vector<PV>& gate) {
  const int64_t d = cfg.d_model;
  RreWeights r;
  r.offset.push_back(0);
  for (const GroupSpec& g : cfg.groups) {
    auto leaf = [&](const char* t) { return pv(ps, names::expert(l, g.name, t)); };
    if (!ps.contains(names::expert(l, g.name, names::kWIn))) {  // in a store: bound step by step
      r.expert.resize(r.expert.size() + size_t(g.experts));
      r.expert_grad.resize(r.expert_grad.size() + size_t(g.experts));
    } else {
      const PV wi = leaf(names::kWIn), bi = leaf(names::kBIn), wo = leaf(names::kWOut),
               bo = leaf(names::kBOut);
      // This rank's columns of each expert (all of them at tp = 1): b_in is [K, f/tp]. (Not
      // w_in's shape: an inference model has freed its fp32 matrices, Model::use_weights.)
      const int64_t f = ps.at(names::expert(l, g.name, names::kBIn)).value.dim(1);
      for (int64_t e = 0; e < g.experts; ++e) {
        r.expert.push_back({{.v = wi.v + e * d * f}, bi.v + e * f, {.v = wo.v + e * f * d}, bo.v + e * d});
        r.expert_grad.push_back({wi.g + e * d * f, bi.g + e * f, wo.g + e * f * d, bo.g + e * d});
      }
    }
    r.offset.push_back(r.offset.back() + g.experts);
    if (cfg.gated()) gate.push_back(pv(ps, names::gate(l, g.name)));
    r.table.push_back(cfg.gated() ? nullptr
                                  : bs.at(names::routing(l, g.name)).value.data<int32_t>());
  }
  return r;
}

}  // namespace

ModelWeights ModelWeights::bind(ParamSet& ps, const BufferSet& bs, const ModelConfig& cfg) {
  ModelWeights w;
  w.tokens = pv(ps, names::kTokens);
  w.positions = pv(ps, names::kPositions);
  w.lnf_w = pv(ps, names::kFinalLnW);
  w.lnf_b = pv(ps, names::kFinalLnB);
  for (int l = 0; l < cfg.layers; ++l) {
    auto at = [&](const char* leaf) { return pv(ps, names::block(l, leaf)); };
    BlockWeights k;
    k.ln1_w = at("ln1.w");
    k.ln1_b = at("ln1.b");
    k.qkv_w = at("attn.qkv.w");
    k.qkv_b = at("attn.qkv.b");
    k.out_w = at("attn.out.w");
    k.out_b = at("attn.out.b");
    if (l == cfg.layers - 1) k.query = at("attn.query_table");
    k.ln2_w = at("ln2.w");
    k.ln2_b = at("ln2.b");
    if (!cfg.is_rre_block(l)) {
      k.w_in = pv(ps, names::ffn(l, names::kWIn));
      k.b_in = pv(ps, names::ffn(l, names::kBIn));
      k.w_out = pv(ps, names::ffn(l, names::kWOut));
      k.b_out = pv(ps, names::ffn(l, names::kBOut));
    } else {
      k.rre = bind_rre(ps, bs, cfg, l, k.gate);
    }
    w.blocks.push_back(k);
  }
  return w;
}

}  // namespace sigma
