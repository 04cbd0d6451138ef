#include "model/config.h"

#include <fmt/format.h>

#include <algorithm>
#include <set>

#include "core/error.h"

namespace sigma {

namespace {

std::vector<std::string> group_names(const std::vector<GroupSpec>& groups) {
  std::vector<std::string> n;
  for (const auto& g : groups) n.push_back(g.name);
  return n;
}

// A domain whose group is not declared. The usual cause: the domains came from prepared shards
// (their registry's groups) while model.groups kept the built-in synthetic data's defaults, so
// the error spells out the model.groups that covers every domain's group.
[[noreturn]] void undeclared_group(const ModelConfig& m, const DomainSpec& bad) {
  std::vector<std::string> needed;
  for (const auto& d : m.domains)
    if (std::find(needed.begin(), needed.end(), d.group) == needed.end()) needed.push_back(d.group);
  std::string list;
  for (const auto& n : needed) {
    int k = 2;  // a declared group keeps its experts; a new one gets 2 (to be chosen)
    for (const auto& g : m.groups)
      if (g.name == n) k = g.experts;
    list += fmt::format("{}{{\"name\":\"{}\",\"experts\":{}}}", list.empty() ? "" : ",", n, k);
  }
  const bool synthetic = group_names(m.groups) == std::vector<std::string>{"markov", "copy", "arith"};
  fail("model.domains: domain '{}' names group '{}', which model.groups does not declare "
       "(declared: {}{}). model.groups must declare every group the domains name (the domains "
       "and their groups come from the prepared data's manifest.json when model.domains is "
       "empty): set it in the config file, e.g. \"model\": {{\"groups\": [{}]}}, or with "
       "--set 'model.groups=[{}]' (choose each group's experts); or train a dense model "
       "(model.rre_layers = 0), which needs no groups",
       bad.name, bad.group,
       m.groups.empty() ? std::string("none") : fmt::format("{}", fmt::join(group_names(m.groups), ", ")),
       synthetic ? ", the defaults for the built-in synthetic data" : "", list, list);
}

bool valid_group_name(const std::string& s) {
  if (s.empty()) return false;
  for (char c : s)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-')) return false;
  return true;
}

}  // namespace

int ModelConfig::domain_index(const std::string& name) const { return domains.index(name); }

int ModelConfig::group_index(const std::string& name) const {
  for (size_t i = 0; i < groups.size(); ++i)
    if (groups[i].name == name) return static_cast<int>(i);
  fail("unknown expert group '{}' (model.groups declares: {})", name,
       groups.empty() ? std::string("none") : fmt::format("{}", fmt::join(group_names(groups), ", ")));
}

void ModelConfig::validate() const {
  SIGMA_CHECK(vocab > 0, "model.vocab must be positive (got {})", vocab);
  SIGMA_CHECK(d_model % heads == 0, "model.d_model ({}) must be divisible by model.heads ({})",
              d_model, heads);
  SIGMA_CHECK(layers >= 1, "model.layers must be at least 1 (the query layer)");
  SIGMA_CHECK(rre_layers >= 0 && rre_layers <= layers,
              "model.rre_layers = {} must lie in 0..model.layers ({})", rre_layers, layers);
  SIGMA_CHECK(rre_layers == 0 || !groups.empty(),
              "model.rre_layers = {} needs expert groups, but model.groups is empty (add "
              "{{\"name\": ..., \"experts\": K}} entries or set model.rre_layers = 0)", rre_layers);
  SIGMA_CHECK(routing == "random" || routing == "frequency",
              "model.routing = '{}' (allowed: random, frequency)", routing);
  SIGMA_CHECK(router == "rre" || router == "top1" || router == "top2",
              "model.router = '{}' (allowed: rre, top1, top2)", router);
  SIGMA_CHECK(capacity_factor > 0, "model.capacity_factor must be positive (got {})",
              capacity_factor);
  SIGMA_CHECK(aux_loss_weight >= 0, "model.aux_loss_weight must not be negative (got {})",
              aux_loss_weight);
  std::set<std::string> gseen;
  for (const auto& g : groups) {
    SIGMA_CHECK(valid_group_name(g.name), "model.groups: group name '{}' must be non-empty and "
                "use only letters, digits, '_' and '-' (it becomes part of tensor names)", g.name);
    SIGMA_CHECK(gseen.insert(g.name).second, "model.groups: group '{}' is declared twice", g.name);
    SIGMA_CHECK(g.experts >= 1, "model.groups: group '{}' has {} experts (needs at least 1)",
                g.name, g.experts);
  }
  SIGMA_CHECK(!domains.empty(), "model.domains is empty: at least one domain is needed");
  const bool need_groups = rre_layers > 0;  // a dense model ignores groups
  std::set<std::string> seen;
  for (const auto& d : domains) {
    SIGMA_CHECK(!d.name.empty(), "model.domains: a domain has an empty name");
    SIGMA_CHECK(seen.insert(d.name).second, "model.domains: domain '{}' is declared twice", d.name);
    SIGMA_CHECK(d.slot >= 0 && d.slot < slots,
                "model.domains: domain '{}' has slot {} but model.slots = {} (allowed 0..{})",
                d.name, d.slot, slots, slots - 1);
    if (need_groups && !gseen.count(d.group)) undeclared_group(*this, d);
  }
}


void ModelConfig::describe(Options& o, const std::string& p) {
  o.add(p + "vocab", &vocab, "vocabulary size V (0 = from the data)", 0, 1 << 24);
  o.add(p + "d_model", &d_model, "model width d", 8, 16384);
  o.add(p + "heads", &heads, "attention heads", 1, 256);
  o.add(p + "context", &context, "context length T", 2, 65536);
  o.add(p + "layers", &layers, "blocks L (the last is the query layer)", 1, 256);
  o.add(p + "slots", &slots, "embedding slots S", 1, 64);
  o.add(p + "init_std", &init_std, "std of the normal initialisation", 1e-6, 1.0);
  o.add(p + "rre_layers", &rre_layers,
        "top blocks with Random Routed Experts, query layer included (0 = dense)", 0, 256);
  o.add(p + "routing_seed", &routing_seed, "seed of the routing tables");
  o.add(p + "routing", &routing, "how routing tables are built", {"random", "frequency"});
  o.add(p + "router", &router,
        "expert choice in the expert blocks: rre (routing tables) or the learned-gate baseline "
        "top1 (Switch) / top2 (GShard)", {"rre", "top1", "top2"});
  o.add(p + "capacity_factor", &capacity_factor,
        "learned gate: an expert takes at most capacity_factor * k * rows / K rows of a batch",
        1e-3, 1e6);
  o.add(p + "aux_loss_weight", &aux_loss_weight,
        "learned gate: weight of the load-balancing loss per block", 0.0, 1e6);
  o.add_json(
      p + "groups", "list of {name, experts}: expert groups of the RRE blocks",
      [this, p](const nlohmann::json& j) {
        SIGMA_CHECK(j.is_array(), "config key '{}groups' must be a list of objects", p);
        std::vector<GroupSpec> out;
        for (const auto& e : j) {
          SIGMA_CHECK(e.is_object() && e.contains("name") && e["name"].is_string(),
                      "config key '{}groups': each entry needs a string 'name'", p);
          GroupSpec g{e["name"].get<std::string>(), 1};
          for (auto it = e.begin(); it != e.end(); ++it) {
            if (it.key() == "name") continue;
            SIGMA_CHECK(it.key() == "experts", "config key '{}groups' entry '{}': unknown field "
                        "'{}' (allowed: name, experts)", p, g.name, it.key());
            SIGMA_CHECK(it->is_number_integer(), "config key '{}groups' entry '{}': 'experts' "
                        "must be an integer", p, g.name);
            const int64_t k = it->get<int64_t>();
            SIGMA_CHECK(k >= 1 && k <= (1 << 20), "config key '{}groups' entry '{}': 'experts' "
                        "= {} (needs 1..{})", p, g.name, k, 1 << 20);
            g.experts = int(k);
          }
          out.push_back(g);
        }
        groups = std::move(out);
      },
      [this] {
        nlohmann::json j = nlohmann::json::array();
        for (const auto& g : groups) j.push_back({{"name", g.name}, {"experts", g.experts}});
        return j;
      });
  o.add_json(
      p + "domains",
      "list of {name, group, slot} (group defaults to the domain's name, slot to 0); the data "
      "registry's id, prefix and format are accepted too",
      [this, p](const nlohmann::json& j) {
        domains = DomainRegistry::from_json(j, p + "domains", DomainForm::Model);
      },
      [this] { return domains.to_json(DomainForm::Model); });
}

}  // namespace sigma
