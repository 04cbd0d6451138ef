// Domain registry (DESIGN.md §5): every sample carries its domain; the model routes on the
// domain's group and embedding slot, and the data pipeline prefixes its control tokens.
#pragma once
#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace sigma::data {

// Plain: prefix + text + <EOT>. Bilingual: each line of the text tagged <EN> or <CN> by script.
enum class SampleFormat : uint8_t { Plain, Bilingual };

struct Domain {
  std::string name{};
  uint32_t id = 0;                  // stable id stored in shards and batches
  std::string group{};              // RRE domain group; defaults to the name
  uint32_t slot = 0;                // embedding slot; defaults to the id
  std::vector<std::string> prefix{};  // control tokens put before every sample, e.g. <Python>
  SampleFormat format = SampleFormat::Plain;
};

struct DomainRegistry {
  std::vector<Domain> domains;  // in config order

  // `j` is an array of {"name", "id"?, "group"?, "slot"?, "prefix"?, "format"?}; `where` names
  // the config in error messages ("data.json: domains[2].slot: ...").
  static DomainRegistry from_json(const nlohmann::json& j, const std::string& where);
  nlohmann::json to_json() const;
  const Domain* find(std::string_view name) const;
  const Domain& at(std::string_view name) const;  // throws Error listing the known names
  std::vector<std::string> names() const;
  size_t size() const { return domains.size(); }
};

nlohmann::json to_json(const Domain& d);

}  // namespace sigma::data
