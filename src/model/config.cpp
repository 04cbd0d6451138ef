#include "model/config.h"

#include <fmt/format.h>

#include <set>

#include "core/error.h"

namespace sigma {

int ModelConfig::domain_index(const std::string& name) const {
  std::vector<std::string> names;
  for (size_t i = 0; i < domains.size(); ++i) {
    if (domains[i].name == name) return static_cast<int>(i);
    names.push_back(domains[i].name);
  }
  fail("unknown domain '{}' (known domains: {})", name, fmt::join(names, ", "));
}

void ModelConfig::validate() const {
  SIGMA_CHECK(vocab > 0, "model.vocab must be positive (got {})", vocab);
  SIGMA_CHECK(d_model % heads == 0, "model.d_model ({}) must be divisible by model.heads ({})",
              d_model, heads);
  SIGMA_CHECK(layers >= 1, "model.layers must be at least 1 (the query layer)");
  SIGMA_CHECK(!domains.empty(), "model.domains is empty: at least one domain is needed");
  std::set<std::string> seen;
  for (const auto& d : domains) {
    SIGMA_CHECK(!d.name.empty(), "model.domains: a domain has an empty name");
    SIGMA_CHECK(seen.insert(d.name).second, "model.domains: domain '{}' is declared twice", d.name);
    SIGMA_CHECK(d.slot >= 0 && d.slot < slots,
                "model.domains: domain '{}' has slot {} but model.slots = {} (allowed 0..{})",
                d.name, d.slot, slots, slots - 1);
    SIGMA_CHECK(d.group >= 0, "model.domains: domain '{}' has a negative group", d.name);
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
  o.add_json(
      p + "domains", "list of {name, group, slot}",
      [this, p](const nlohmann::json& j) {
        SIGMA_CHECK(j.is_array(), "config key '{}domains' must be a list of objects", p);
        std::vector<DomainSpec> out;
        for (const auto& e : j) {
          SIGMA_CHECK(e.is_object() && e.contains("name") && e["name"].is_string(),
                      "config key '{}domains': each entry needs a string 'name'", p);
          DomainSpec d{e["name"].get<std::string>(), 0, 0};
          for (auto it = e.begin(); it != e.end(); ++it) {
            if (it.key() == "name") continue;
            SIGMA_CHECK(it.key() == "group" || it.key() == "slot",
                        "config key '{}domains' entry '{}': unknown field '{}' (allowed: name, "
                        "group, slot)", p, d.name, it.key());
            SIGMA_CHECK(it->is_number_integer(), "config key '{}domains' entry '{}': '{}' must be "
                        "an integer", p, d.name, it.key());
            (it.key() == "group" ? d.group : d.slot) = it->get<int>();
          }
          out.push_back(d);
        }
        domains = std::move(out);
      },
      [this] {
        nlohmann::json j = nlohmann::json::array();
        for (const auto& d : domains)
          j.push_back({{"name", d.name}, {"group", d.group}, {"slot", d.slot}});
        return j;
      });
}

}  // namespace sigma
