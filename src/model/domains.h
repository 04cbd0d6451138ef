// The domain registry (DESIGN §2, §5): one record per domain, read by the model (its expert group
// and embedding slot) and by the data pipeline (its shard id, prefix tokens and format). It lives
// here, under both, so that the model config and the data's manifests share one type and one
// JSON reader and writer.
#pragma once
#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>
#include <vector>

namespace sigma {

// How prepare turns a sample into tokens. Plain: prefix + text + <EOT>. Bilingual: each line of
// the text tagged <EN> or <CN> by script.
enum class SampleFormat : uint8_t { Plain, Bilingual };

struct DomainSpec {
  std::string name;
  std::string group;  // name of its expert group in ModelConfig::groups (RRE blocks)
  int slot = 0;       // embedding slot: the domain's tokens read rows slot*V + id
  // The data pipeline's fields; the model knows a domain by its position in the registry.
  uint32_t id = 0;                  // stable id stored in shards and data batches
  std::vector<std::string> prefix;  // control tokens put before every sample, e.g. <Python>
  SampleFormat format = SampleFormat::Plain;

  DomainSpec() = default;
  DomainSpec(std::string n, std::string g, int s)
      : name(std::move(n)), group(std::move(g)), slot(s) {}
  // Groups are named, not numbered: {"a", 0, 0} would turn 0 into a null string.
  DomainSpec(std::string, int, int) = delete;
};

// Where a list of domains is read from or written to. One reader serves both; they differ in
// what may be left out and in what is written.
enum class DomainForm {
  // model.domains: may be empty (the data then decides); slot defaults to 0; written as
  // {name, group, slot}, the fields the model reads.
  Model,
  // prepare's data.json and a shard manifest: not empty; names become shard file names; slot
  // defaults to the id; written with every field.
  Data,
};

// The domains in config order; a model's domain index is the position here.
class DomainRegistry {
 public:
  DomainRegistry() = default;
  DomainRegistry(std::initializer_list<DomainSpec> d) : domains_(d) {}

  // `j` is an array of {"name", "group"?, "slot"?, "id"?, "prefix"?, "format"?}. A missing group
  // is the domain's name, a missing id its index. Errors name the key after `where`
  // ("data.json: domains[2].slot: ..."); ids and names must be unique.
  static DomainRegistry from_json(const nlohmann::json& j, const std::string& where,
                                  DomainForm form);
  nlohmann::json to_json(DomainForm form) const;

  const DomainSpec* find(std::string_view name) const;  // null when absent
  const DomainSpec& at(std::string_view name) const;    // throws naming the known domains
  int index(std::string_view name) const;               // throws naming the known domains
  std::vector<std::string> names() const;

  size_t size() const { return domains_.size(); }
  bool empty() const { return domains_.empty(); }
  const DomainSpec& operator[](size_t i) const { return domains_[i]; }
  DomainSpec& operator[](size_t i) { return domains_[i]; }
  auto begin() const { return domains_.begin(); }
  auto end() const { return domains_.end(); }
  auto begin() { return domains_.begin(); }
  auto end() { return domains_.end(); }
  void push_back(DomainSpec d) { domains_.push_back(std::move(d)); }
  void clear() { domains_.clear(); }

 private:
  std::vector<DomainSpec> domains_;
};

// One domain as `form` writes it (prepare hashes the Data form to know when a shard is current).
nlohmann::json to_json(const DomainSpec& d, DomainForm form);

}  // namespace sigma
