#include "data/domains.h"

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace sigma::data {

namespace {

using nlohmann::json;

const char* format_name(SampleFormat f) { return f == SampleFormat::Bilingual ? "bilingual" : "plain"; }

// Reads an optional key of a given kind; errors name the full key path.
struct Reader {
  const json& j;
  std::string path;
  const json* get(const char* k, bool (json::*is)() const, const char* kind) const {
    auto it = j.find(k);
    if (it == j.end()) return nullptr;
    SIGMA_CHECK(((*it).*is)(), "{}.{}: must be {}", path, k, kind);
    return &*it;
  }
};

}  // namespace

DomainRegistry DomainRegistry::from_json(const json& j, const std::string& where) {
  SIGMA_CHECK(j.is_array() && !j.empty(), "{}: must be a non-empty array of domains", where);
  DomainRegistry reg;
  for (size_t i = 0; i < j.size(); ++i) {
    std::string path = fmt::format("{}[{}]", where, i);
    SIGMA_CHECK(j[i].is_object(), "{}: must be an object with a \"name\"", path);
    for (auto& [k, v] : j[i].items())
      SIGMA_CHECK(k == "name" || k == "id" || k == "group" || k == "slot" || k == "prefix" ||
                      k == "format",
                  "{}: unknown key \"{}\" (known: name, id, group, slot, prefix, format)", path, k);
    Reader r{j[i], path};
    Domain d;
    const json* name = r.get("name", &json::is_string, "a string");
    SIGMA_CHECK(name && !name->get<std::string>().empty(), "{}.name: missing or empty", path);
    d.name = name->get<std::string>();
    SIGMA_CHECK(d.name.find_first_of("/\\ \t\n") == std::string::npos && d.name != "." && d.name != "..",
                "{}.name: '{}' must be usable as a file name", path, d.name);
    SIGMA_CHECK(!reg.find(d.name), "{}.name: domain '{}' is declared twice", path, d.name);
    d.id = static_cast<uint32_t>(i);
    if (auto* v = r.get("id", &json::is_number_unsigned, "a non-negative integer")) {
      SIGMA_CHECK(v->get<uint64_t>() < 65536, "{}.id: must be below 65536", path);
      d.id = v->get<uint32_t>();
    }
    for (auto& o : reg.domains)
      SIGMA_CHECK(o.id != d.id, "{}.id: id {} is already used by domain '{}'", path, d.id, o.name);
    d.group = d.name;
    if (auto* v = r.get("group", &json::is_string, "a string")) d.group = v->get<std::string>();
    d.slot = d.id;
    if (auto* v = r.get("slot", &json::is_number_unsigned, "a non-negative integer"))
      d.slot = v->get<uint32_t>();
    if (auto* v = r.get("prefix", &json::is_array, "an array of control-token names")) {
      for (auto& p : *v) {
        SIGMA_CHECK(p.is_string(), "{}.prefix: must be an array of strings", path);
        d.prefix.push_back(p.get<std::string>());
      }
    }
    if (auto* v = r.get("format", &json::is_string, "\"plain\" or \"bilingual\"")) {
      auto f = v->get<std::string>();
      SIGMA_CHECK(f == "plain" || f == "bilingual", "{}.format: '{}' is not \"plain\" or \"bilingual\"",
                  path, f);
      d.format = f == "bilingual" ? SampleFormat::Bilingual : SampleFormat::Plain;
    }
    reg.domains.push_back(std::move(d));
  }
  return reg;
}

json to_json(const Domain& d) {
  return {{"name", d.name}, {"id", d.id},         {"group", d.group},
          {"slot", d.slot}, {"prefix", d.prefix}, {"format", format_name(d.format)}};
}

json DomainRegistry::to_json() const {
  json a = json::array();
  for (auto& d : domains) a.push_back(data::to_json(d));
  return a;
}

const Domain* DomainRegistry::find(std::string_view name) const {
  for (auto& d : domains)
    if (d.name == name) return &d;
  return nullptr;
}

const Domain& DomainRegistry::at(std::string_view name) const {
  if (auto* d = find(name)) return *d;
  fail("unknown domain '{}' (declared: {})", name, fmt::join(names(), ", "));
}

std::vector<std::string> DomainRegistry::names() const {
  std::vector<std::string> n;
  for (auto& d : domains) n.push_back(d.name);
  return n;
}

}  // namespace sigma::data
