// Typed options: one table of (key, typed field, help, allowed values) drives the JSON config
// reader, `--set key=value`, the help text and the config dump stored in checkpoints, so the
// four can never drift apart. Unknown keys and bad values are errors that name the key.
#pragma once
#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <string>
#include <variant>
#include <vector>

namespace sigma {

class Options {
 public:
  void add(std::string key, int* v, std::string help, int64_t lo, int64_t hi);
  void add(std::string key, int64_t* v, std::string help, int64_t lo, int64_t hi);
  void add(std::string key, uint64_t* v, std::string help);
  void add(std::string key, float* v, std::string help, double lo, double hi);
  void add(std::string key, bool* v, std::string help);
  // A string; `allowed` empty means any value.
  void add(std::string key, std::string* v, std::string help, std::vector<std::string> allowed = {});
  // A JSON-valued field (lists of records); `set` parses and validates, `get` dumps.
  void add_json(std::string key, std::string help, std::function<void(const nlohmann::json&)> set,
                std::function<nlohmann::json()> get);

  // Nested objects are flattened with '.': {"model": {"d_model": 64}} sets "model.d_model".
  void apply_json(const nlohmann::json& j, const std::string& source);
  // "key=value": value parsed by the field's type (JSON syntax for JSON-valued fields).
  void apply_set(const std::string& assignment);
  nlohmann::json to_json() const;  // nested, round-trips through apply_json
  std::string help() const;
  std::vector<std::string> keys() const;

 private:
  struct Field;
  Field& find(const std::string& key);
  void set_from_json(Field& f, const nlohmann::json& v);
  std::vector<Field> fields_;

 public:
  Options();
  ~Options();
  Options(Options&&) noexcept;
};

}  // namespace sigma
