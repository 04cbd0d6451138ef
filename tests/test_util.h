// Small helpers many test files share: a whole file as a string, a JSON file, and bit-for-bit
// equality of float arrays and host tensors.
#pragma once
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/tensor.h"
#include "model/config.h"

namespace sigma::testing {

// The file's bytes ("" when it cannot be read).
inline std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// The file's JSON (throws nlohmann::json::parse_error on a bad or missing file).
inline nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}

// A JSON Lines file: one value per line.
inline std::vector<nlohmann::json> read_json_lines(const std::string& path) {
  std::vector<nlohmann::json> out;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line));
  return out;
}

inline bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Host tensors (a checkpoint's, a file's): same dtype, shape and bytes.
inline bool same_bits(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() &&
         std::memcmp(a.bytes(), b.bytes(), a.nbytes()) == 0;
}

// The model and gate tests' tiny model: three blocks of width 12 over 13 tokens, two domains,
// weights drawn large enough that every path carries a visible gradient.
inline ModelConfig tiny_config() {
  ModelConfig c;
  c.vocab = 13;
  c.d_model = 12;
  c.heads = 3;
  c.context = 6;
  c.layers = 3;
  c.slots = 2;
  c.init_std = 0.3f;
  c.domains = {{"a", "a", 0}, {"b", "b", 1}};
  return c;
}

}  // namespace sigma::testing
