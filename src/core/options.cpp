#include "core/options.h"

#include <fmt/format.h>

#include <cmath>
#include <limits>
#include <string_view>

#include "core/error.h"
#include "core/json_depth.h"

namespace sigma {

struct Options::Field {
  std::string key, help;
  std::variant<int*, int64_t*, uint64_t*, float*, bool*, std::string*, std::monostate> target;
  double lo = 0, hi = 0;
  std::vector<std::string> allowed;
  std::function<void(const nlohmann::json&)> set_json;
  std::function<nlohmann::json()> get_json;
};

Options::Options() = default;
Options::~Options() = default;
Options::Options(Options&&) noexcept = default;

void Options::add(std::string key, int* v, std::string help, int64_t lo, int64_t hi) {
  fields_.push_back({std::move(key), std::move(help), v, double(lo), double(hi), {}, {}, {}});
}
void Options::add(std::string key, int64_t* v, std::string help, int64_t lo, int64_t hi) {
  fields_.push_back({std::move(key), std::move(help), v, double(lo), double(hi), {}, {}, {}});
}
void Options::add(std::string key, uint64_t* v, std::string help) {
  fields_.push_back({std::move(key), std::move(help), v, 0, 0, {}, {}, {}});
}
void Options::add(std::string key, float* v, std::string help, double lo, double hi) {
  fields_.push_back({std::move(key), std::move(help), v, lo, hi, {}, {}, {}});
}
void Options::add(std::string key, bool* v, std::string help) {
  fields_.push_back({std::move(key), std::move(help), v, 0, 0, {}, {}, {}});
}
void Options::add(std::string key, std::string* v, std::string help,
                  std::vector<std::string> allowed) {
  fields_.push_back({std::move(key), std::move(help), v, 0, 0, std::move(allowed), {}, {}});
}
void Options::add_json(std::string key, std::string help,
                       std::function<void(const nlohmann::json&)> set,
                       std::function<nlohmann::json()> get) {
  fields_.push_back({std::move(key), std::move(help), std::monostate{}, 0, 0, {}, std::move(set),
                     std::move(get)});
}

std::vector<std::string> Options::keys() const {
  std::vector<std::string> k;
  for (const auto& f : fields_) k.push_back(f.key);
  return k;
}

Options::Field& Options::find(const std::string& key) {
  for (auto& f : fields_)
    if (f.key == key) return f;
  fail("unknown config key '{}' (known keys: {})", key, fmt::join(keys(), ", "));
}

static std::string range_str(double lo, double hi) { return fmt::format("[{}, {}]", lo, hi); }

void Options::set_from_json(Field& f, const nlohmann::json& v) {
  auto integer = [&](int64_t& out) {
    SIGMA_CHECK(v.is_number_integer(), "config key '{}' must be an integer in {}, got {}", f.key,
                range_str(f.lo, f.hi), v.dump());
    out = v.get<int64_t>();
    SIGMA_CHECK(out >= f.lo && out <= f.hi, "config key '{}' = {} is out of range {}", f.key, out,
                range_str(f.lo, f.hi));
  };
  std::visit(
      [&](auto p) {
        using P = decltype(p);
        if constexpr (std::is_same_v<P, std::monostate>) {
          return;  // JSON-valued fields are handled by their own setter
        } else {
          using T = std::remove_pointer_t<P>;
          if constexpr (std::is_same_v<T, int>) {
            int64_t x;
            integer(x);
            *p = static_cast<int>(x);
          } else if constexpr (std::is_same_v<T, int64_t>) {
            integer(*p);
          } else if constexpr (std::is_same_v<T, uint64_t>) {
            SIGMA_CHECK(v.is_number_unsigned() || (v.is_number_integer() && v.get<int64_t>() >= 0),
                        "config key '{}' must be a non-negative integer, got {}", f.key, v.dump());
            *p = v.get<uint64_t>();
          } else if constexpr (std::is_same_v<T, float>) {
            SIGMA_CHECK(v.is_number(), "config key '{}' must be a number in {}, got {}", f.key,
                        range_str(f.lo, f.hi), v.dump());
            double x = v.get<double>();
            SIGMA_CHECK(std::isfinite(x) && x >= f.lo && x <= f.hi,
                        "config key '{}' = {} is out of range {}", f.key, x, range_str(f.lo, f.hi));
            *p = static_cast<float>(x);
          } else if constexpr (std::is_same_v<T, bool>) {
            SIGMA_CHECK(v.is_boolean(), "config key '{}' must be true or false, got {}", f.key,
                        v.dump());
            *p = v.get<bool>();
          } else {
            SIGMA_CHECK(v.is_string(), "config key '{}' must be a string, got {}", f.key, v.dump());
            std::string s = v.get<std::string>();
            bool ok = f.allowed.empty();
            for (const auto& a : f.allowed) ok |= (a == s);
            SIGMA_CHECK(ok, "config key '{}' = '{}' is not allowed (allowed: {})", f.key, s,
                        fmt::join(f.allowed, ", "));
            *p = s;
          }
        }
      },
      f.target);
}

void Options::apply_json(const nlohmann::json& j, const std::string& source) {
  SIGMA_CHECK(j.is_object(), "{}: the config must be a JSON object", source);
  std::function<void(const nlohmann::json&, const std::string&)> walk =
      [&](const nlohmann::json& node, const std::string& prefix) {
        for (auto it = node.begin(); it != node.end(); ++it) {
          std::string key = prefix.empty() ? it.key() : prefix + "." + it.key();
          bool is_field = false;
          for (auto& f : fields_) is_field |= (f.key == key);
          if (!is_field && it->is_object()) {
            walk(*it, key);
            continue;
          }
          Field& f = find(key);
          try {
            if (f.set_json)
              f.set_json(*it);
            else
              set_from_json(f, *it);
          } catch (const Error& e) {
            fail("{}: {}", source, e.what());
          }
        }
      };
  walk(j, "");
}

void Options::apply_set(const std::string& assignment) {
  auto eq = assignment.find('=');
  SIGMA_CHECK(eq != std::string::npos && eq > 0, "--set expects key=value, got '{}'", assignment);
  std::string key = assignment.substr(0, eq), text = assignment.substr(eq + 1);
  Field& f = find(key);
  nlohmann::json v;
  if (f.set_json) {
    v = nlohmann::json::parse(text, json_depth_limit("--set " + key), false);
    // A bare word (--set train.freeze=shared) is the JSON string it spells; what starts as
    // JSON must parse.
    if (v.is_discarded() && !text.empty() && std::string_view("[{\"").find(text[0]) == std::string_view::npos)
      v = text;
    SIGMA_CHECK(!v.is_discarded(), "--set {}: value is not valid JSON", key);
    f.set_json(v);
    return;
  }
  if (std::holds_alternative<std::string*>(f.target)) {
    v = text;
  } else {
    v = nlohmann::json::parse(text, json_depth_limit("--set " + key), false);
    SIGMA_CHECK(!v.is_discarded(), "--set {}: cannot parse '{}' as a value for this key", key,
                text);
  }
  set_from_json(f, v);
}

nlohmann::json Options::to_json() const {
  nlohmann::json out = nlohmann::json::object();
  for (const auto& f : fields_) {
    nlohmann::json v;
    if (f.get_json)
      v = f.get_json();
    else
      std::visit(
          [&](auto p) {
            if constexpr (!std::is_same_v<decltype(p), std::monostate>) v = *p;
          },
          f.target);
    out[nlohmann::json::json_pointer("/" + [&] {
      std::string k = f.key;
      for (auto& c : k)
        if (c == '.') c = '/';
      return k;
    }())] = v;
  }
  return out;
}

std::string Options::help() const {
  std::string s;
  for (const auto& f : fields_) {
    std::string extra;
    std::visit(
        [&](auto p) {
          using P = decltype(p);
          if constexpr (std::is_same_v<P, int*> || std::is_same_v<P, int64_t*> ||
                        std::is_same_v<P, float*>)
            extra = " " + range_str(f.lo, f.hi);
          else if constexpr (std::is_same_v<P, std::string*>)
            if (!f.allowed.empty()) extra = fmt::format(" {{{}}}", fmt::join(f.allowed, "|"));
        },
        f.target);
    s += fmt::format("  {:<28} {}{}\n", f.key, f.help, extra);
  }
  return s;
}

}  // namespace sigma
