#include "model/domains.h"

#include <fmt/format.h>

#include <algorithm>
#include <nlohmann/json.hpp>

#include "core/error.h"

namespace sigma {

namespace {

using nlohmann::json;

constexpr const char* kKeys[] = {"name", "group", "slot", "id", "prefix", "format"};

const char* format_name(SampleFormat f) {
  return f == SampleFormat::Bilingual ? "bilingual" : "plain";
}

bool is_string(const json& v) { return v.is_string(); }
bool is_array(const json& v) { return v.is_array(); }
// Ids and slots: shard headers and batches store ids in 16 bits; no model has 65536 slots.
bool is_small_count(const json& v) {
  return v.is_number_integer() && v.get<int64_t>() >= 0 && v.get<int64_t>() < 65536;
}

// One entry's optional keys, each checked by kind; errors name the key path.
struct Entry {
  const json& j;
  std::string path;  // e.g. "model.domains[2]"
  const json* get(const char* k, bool (*ok)(const json&), const char* kind) const {
    auto it = j.find(k);
    if (it == j.end()) return nullptr;
    SIGMA_CHECK(ok(*it), "{}.{}: '{}' must be {}", path, k, k, kind);
    return &*it;
  }
};

void check_keys(const json& e, const std::string& path) {
  SIGMA_CHECK(e.is_object(), "{}: must be an object with a \"name\"", path);
  for (auto& [k, v] : e.items())
    SIGMA_CHECK(std::find(std::begin(kKeys), std::end(kKeys), k) != std::end(kKeys),
                "{}: unknown key \"{}\" (known: {})", path, k, fmt::join(kKeys, ", "));
}

std::string read_name(const Entry& r, DomainForm form) {
  const json* name = r.get("name", is_string, "a string");
  SIGMA_CHECK(name && !name->get<std::string>().empty(), "{}.name: missing or empty", r.path);
  std::string n = name->get<std::string>();
  // The data pipeline names a domain's shard file after it.
  SIGMA_CHECK(form != DomainForm::Data ||
                  (n.find_first_of("/\\ \t\n") == std::string::npos && n != "." && n != ".."),
              "{}.name: '{}' must be usable as a file name", r.path, n);
  return n;
}

// The data pipeline's fields: prefix tokens and the sample format.
void read_formatting(const Entry& r, DomainSpec& d) {
  if (auto* v = r.get("prefix", is_array, "an array of control-token names")) {
    for (auto& p : *v) {
      SIGMA_CHECK(p.is_string(), "{}.prefix: must be an array of strings", r.path);
      d.prefix.push_back(p.get<std::string>());
    }
  }
  if (auto* v = r.get("format", is_string, "\"plain\" or \"bilingual\"")) {
    const auto f = v->get<std::string>();
    SIGMA_CHECK(f == "plain" || f == "bilingual",
                "{}.format: '{}' is not \"plain\" or \"bilingual\"", r.path, f);
    d.format = f == "bilingual" ? SampleFormat::Bilingual : SampleFormat::Plain;
  }
}

DomainSpec read_domain(const json& e, const std::string& path, size_t index, DomainForm form) {
  check_keys(e, path);
  const Entry r{e, path};
  DomainSpec d;
  d.name = read_name(r, form);
  d.id = uint32_t(index);
  if (auto* v = r.get("id", is_small_count, "a non-negative integer below 65536"))
    d.id = v->get<uint32_t>();
  d.group = d.name;
  if (auto* v = r.get("group", is_string, "the name of an expert group (a string)"))
    d.group = v->get<std::string>();
  // A data registry gives each domain its own slot unless told; a model config shares slot 0.
  d.slot = form == DomainForm::Data ? int(d.id) : 0;
  if (auto* v = r.get("slot", is_small_count, "a non-negative integer below 65536"))
    d.slot = v->get<int>();
  read_formatting(r, d);
  return d;
}

}  // namespace

DomainRegistry DomainRegistry::from_json(const json& j, const std::string& where,
                                         DomainForm form) {
  const bool data = form == DomainForm::Data;
  SIGMA_CHECK(j.is_array() && !(data && j.empty()), "{}: must be a {}array of domains", where,
              data ? "non-empty " : "");
  DomainRegistry reg;
  for (size_t i = 0; i < j.size(); ++i) {
    const std::string path = fmt::format("{}[{}]", where, i);
    DomainSpec d = read_domain(j[i], path, i, form);
    SIGMA_CHECK(!reg.find(d.name), "{}.name: domain '{}' is declared twice", path, d.name);
    for (const DomainSpec& o : reg)
      SIGMA_CHECK(o.id != d.id, "{}.id: id {} is already used by domain '{}'", path, d.id, o.name);
    reg.push_back(std::move(d));
  }
  return reg;
}

json to_json(const DomainSpec& d, DomainForm form) {
  json j = {{"name", d.name}, {"group", d.group}, {"slot", d.slot}};
  if (form == DomainForm::Data) {
    j["id"] = d.id;
    j["prefix"] = d.prefix;
    j["format"] = format_name(d.format);
  }
  return j;
}

json DomainRegistry::to_json(DomainForm form) const {
  json a = json::array();
  for (const DomainSpec& d : domains_) a.push_back(sigma::to_json(d, form));
  return a;
}

const DomainSpec* DomainRegistry::find(std::string_view name) const {
  for (const DomainSpec& d : domains_)
    if (d.name == name) return &d;
  return nullptr;
}

const DomainSpec& DomainRegistry::at(std::string_view name) const {
  return domains_[size_t(index(name))];
}

int DomainRegistry::index(std::string_view name) const {
  for (size_t i = 0; i < domains_.size(); ++i)
    if (domains_[i].name == name) return int(i);
  // Met when data names a domain the model was not built with, e.g. training an extract (which
  // keeps only the domains it was extracted for) on another domain's shards.
  fail("unknown domain '{}': this model has only the domain{} {} (an extract keeps only the "
       "domains it was extracted for). Use data of {} (prepare shards of that domain, or choose "
       "domains with --domains where the command has it), or give the model the domain first: "
       "sigma domains add --ckpt CKPT --name {} --init-from GROUP --out DIR (docs/surgery.md)",
       name, domains_.size() == 1 ? "" : "s", fmt::join(names(), ", "),
       domains_.size() == 1 ? "that domain" : "those domains", name);
}

std::vector<std::string> DomainRegistry::names() const {
  std::vector<std::string> n;
  for (const DomainSpec& d : domains_) n.push_back(d.name);
  return n;
}

}  // namespace sigma
