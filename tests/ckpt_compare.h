// Checkpoints compared by their tensors, whatever their layout (docs/checkpoints.md: `whole`,
// one model.safetensors plus expert group files; `sharded`, each rank's pieces, the default of
// a multi-rank run). The files' bytes cannot be compared across layouts or rank counts (the
// model file embeds the config; a sharded one cuts tensors into per-rank pieces); the tensors,
// assembled whole by the readers every command uses, can, bit for bit.
#pragma once
#include <cstring>
#include <string>

#include "run/checkpoint.h"

namespace sigma::testing {

// Every tensor of `m` in name order as one string: name, dtype, shape and bytes. Two maps hold
// the same tensors bit for bit exactly when their strings are equal.
inline std::string tensor_map_bits(const TensorMap& m) {
  std::string s;
  for (const auto& [name, t] : m) {
    s += name;
    s += '\0';
    s += dtype_name(t.dtype());
    for (int64_t d : t.shape()) s += ',' + std::to_string(d);
    s += '\0';
    s.append(reinterpret_cast<const char*>(t.bytes()), t.nbytes());
  }
  return s;
}

// The weights of checkpoint directory `dir` (either layout) as tensor_map_bits.
inline std::string weight_bits(const std::string& dir) { return tensor_map_bits(read_model_tensors(dir)); }

// "" when checkpoints a and b hold the same weights (and, with `optimizer`, the same optimizer
// state) bit for bit; else the first difference, named ("tensor 'X' differs", "only in A: X").
inline std::string tensor_difference(const std::string& a, const std::string& b, bool optimizer = false) {
  for (int pass = 0; pass < (optimizer ? 2 : 1); ++pass) {
    const TensorMap ta = pass ? read_optimizer_tensors(a) : read_model_tensors(a);
    const TensorMap tb = pass ? read_optimizer_tensors(b) : read_model_tensors(b);
    for (const auto& [name, t] : ta) {
      const auto it = tb.find(name);
      if (it == tb.end()) return "only in " + a + ": " + name;
      const Tensor& u = it->second;
      if (t.dtype() != u.dtype() || t.shape() != u.shape() ||
          std::memcmp(t.bytes(), u.bytes(), t.nbytes()) != 0)
        return "tensor '" + name + "' differs";
    }
    for (const auto& [name, t] : tb)
      if (!ta.count(name)) return "only in " + b + ": " + name;
  }
  return "";
}

}  // namespace sigma::testing
