#include "train/freeze.h"

#include <fmt/format.h>

#include <algorithm>
#include <set>

#include "core/error.h"
#include "model/names.h"

namespace sigma {

FreezePlan plan_freeze(const std::vector<std::string>& selectors, const ModelConfig& cfg,
                       const ParamSet& ps, bool external_experts,
                       const std::vector<std::string>& trained) {
  FreezePlan plan;
  if (selectors.empty()) {
    plan.summary = "every parameter trains";
    return plan;
  }
  const auto& params = ps.all();
  const int first = cfg.first_rre_block(), G = int(cfg.groups.size());
  const int rre_blocks = cfg.rre_layers > 0 ? cfg.layers - first : 0;
  std::vector<uint8_t> frozen(params.size(), 0);
  std::vector<uint8_t> frozen_experts(size_t(rre_blocks) * G, 0);
  std::set<int> trained_slots;  // "shared": only these slots' rows of embed.tokens train
  bool limit_slots = false;

  // Expert tensors by in-model name, whether they are params or in a store.
  auto expert_index = [&](int l, int g) { return size_t(l - first) * G + size_t(g); };
  for (const std::string& sel : selectors) {
    if (sel == "shared") {
      std::set<std::string> trained_groups;
      for (const auto& n : trained) {
        const DomainSpec& d = cfg.domains[size_t(cfg.domain_index(n))];
        trained_slots.insert(d.slot);
        if (cfg.rre_layers > 0) trained_groups.insert(d.group);
      }
      for (const DomainSpec& d : cfg.domains) {
        if (std::find(trained.begin(), trained.end(), d.name) != trained.end()) continue;
        SIGMA_CHECK(!trained_slots.count(d.slot) && !trained_groups.count(d.group),
                    "train.freeze = shared: domain '{}' is not in the training data but shares "
                    "its {} with a trained domain, so it would change; give the trained "
                    "domains their own slot and group (sigma domains add does)", d.name,
                    trained_slots.count(d.slot) ? fmt::format("embedding slot {}", d.slot)
                                                : fmt::format("expert group '{}'", d.group));
      }
      limit_slots = true;
      for (size_t i = 0; i < params.size(); ++i) {
        const std::string& n = params[i].name;
        if (n == names::kTokens) continue;  // limited to the trained slots below
        bool own = false;
        for (int l = first; l < cfg.layers && rre_blocks > 0; ++l)
          for (const auto& g : trained_groups)
            own = own || n.starts_with(names::expert_prefix(l, g) + ".") ||
                  n.starts_with(names::gate_prefix(l, g) + ".");
        if (!own) frozen[i] = 1;
      }
      for (int l = first; l < cfg.layers && rre_blocks > 0; ++l)
        for (int g = 0; g < G; ++g)
          if (!trained_groups.count(cfg.groups[size_t(g)].name)) frozen_experts[expert_index(l, g)] = 1;
      continue;
    }
    int matched = 0;
    auto match = [&](const std::string& n) {
      if (sel == "embeddings") return n == names::kTokens || n == names::kPositions;
      if (sel == "experts") return false;  // below, by group
      return n.starts_with(sel);
    };
    for (size_t i = 0; i < params.size(); ++i)
      if (match(params[i].name) || (sel == "experts" && params[i].expert)) frozen[i] = 1, ++matched;
    if (external_experts)
      for (int l = first; l < cfg.layers && rre_blocks > 0; ++l)
        for (int g = 0; g < G; ++g) {
          int leaves = 0;
          for (const char* leaf : names::kExpertLeaves)
            leaves += sel == "experts" || match(names::expert(l, cfg.groups[size_t(g)].name, leaf));
          SIGMA_CHECK(leaves == 0 || leaves == 4, "train.freeze: '{}' names only some tensors of "
                      "block {}'s '{}' experts; an expert store freezes whole experts", sel, l,
                      cfg.groups[size_t(g)].name);
          if (leaves) frozen_experts[expert_index(l, g)] = 1, ++matched;
        }
    SIGMA_CHECK(matched > 0 || sel != "experts", "train.freeze: 'experts' names nothing: the model "
                "is dense (model.rre_layers = {}), it has no experts; freeze 'shared', "
                "'embeddings' or a tensor-name prefix", cfg.rre_layers);
    SIGMA_CHECK(matched > 0, "train.freeze: '{}' is not shared, embeddings or experts and no "
                "parameter name starts with it", sel);
  }

  plan.mask.frozen = frozen;
  const auto tok = std::find_if(params.begin(), params.end(),
                                [](const Param& p) { return p.name == names::kTokens; });
  const size_t tok_i = size_t(tok - params.begin());
  if (limit_slots && tok != params.end() && !frozen[tok_i]) {
    if (trained_slots.empty()) {
      plan.mask.frozen[tok_i] = 1;
    } else {
      plan.mask.rows.assign(params.size(), {});
      for (int s : trained_slots)  // std::set: ascending, as mask_grads needs
        plan.mask.rows[tok_i].push_back({int64_t(s) * cfg.vocab, int64_t(s + 1) * cfg.vocab});
    }
  }
  plan.frozen_experts = frozen_experts;

  int64_t trains = 0, total = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    const int64_t n = params[i].value.numel();
    total += n;
    if (plan.mask.frozen[i]) continue;
    if (!plan.mask.rows.empty() && !plan.mask.rows[i].empty()) {
      for (auto [b, e] : plan.mask.rows[i]) trains += (e - b) * (n / params[i].value.dim(0));
    } else {
      trains += n;
    }
  }
  const int64_t per_expert = 2 * int64_t(cfg.d_model) * cfg.ffn() + cfg.ffn() + cfg.d_model;
  if (external_experts)
    for (int l = first; l < cfg.layers && rre_blocks > 0; ++l)
      for (int g = 0; g < G; ++g) {
        const int64_t n = per_expert * cfg.groups[size_t(g)].experts;
        total += n;
        if (!frozen_experts[expert_index(l, g)]) trains += n;
      }
  plan.summary = fmt::format("train.freeze = [{}]: {} of {} parameters train", fmt::join(selectors, ", "),
                             trains, total);
  return plan;
}

void limit_to_batch_rows(UpdateMask& mask, const ParamSet& ps, const ModelConfig& cfg,
                         std::span<const Batch> micro) {
  const auto& params = ps.all();
  size_t tok = 0;
  while (tok < params.size() && params[tok].name != names::kTokens) ++tok;
  SIGMA_CHECK(tok < params.size(), "sparse embeddings: the model has no embed.tokens");
  if (!mask.frozen.empty() && mask.frozen[tok]) return;
  std::vector<uint8_t> used(size_t(params[tok].value.dim(0)), 0);
  for (const Batch& b : micro)
    for (int r = 0; r < b.B; ++r) {
      const int64_t base = int64_t(cfg.domains[size_t(b.domain[size_t(r)])].slot) * cfg.vocab;
      for (int t = 0; t < b.T; ++t) {
        const size_t i = size_t(r) * b.T + t;
        used[size_t(base + b.tokens[i])] = 1;
        used[size_t(base + b.targets[i])] = 1;
      }
    }
  if (!mask.rows.empty() && !mask.rows[tok].empty()) {  // only inside the trainable slots
    std::vector<uint8_t> allowed(used.size(), 0);
    for (auto [b, e] : mask.rows[tok]) std::fill(allowed.begin() + b, allowed.begin() + e, 1);
    for (size_t r = 0; r < used.size(); ++r) used[r] &= allowed[r];
  }
  if (mask.rows.empty()) mask.rows.assign(params.size(), {});
  if (mask.lazy_rows.empty()) mask.lazy_rows.assign(params.size(), 0);
  auto& ranges = mask.rows[tok];
  ranges.clear();
  for (int64_t r = 0; r < int64_t(used.size());) {
    if (!used[size_t(r)]) {
      ++r;
      continue;
    }
    int64_t e = r;
    while (e < int64_t(used.size()) && used[size_t(e)]) ++e;
    ranges.push_back({r, e});
    r = e;
  }
  if (ranges.empty()) {  // no row of the table trains this step
    if (mask.frozen.empty()) mask.frozen.assign(params.size(), 0);
    mask.frozen[tok] = 1;
  }
  mask.lazy_rows[tok] = 1;
}

}  // namespace sigma
