// Parsing the stable tensor names of DESIGN §4 (src/model/weights.h registers them).
#pragma once
#include <string>

namespace sigma::surgery {

// The expert group a tensor belongs to: blocks.L.rre.G.*, blocks.L.gate.G.w, routing.L.G;
// "" for a shared tensor. Group names hold no '.', so G ends at the next dot.
inline std::string group_of(const std::string& name) {
  auto after = [&](const std::string& mark) -> std::string {
    const size_t p = name.find(mark);
    if (p == std::string::npos) return "";
    const size_t b = p + mark.size(), e = name.find('.', b);
    return name.substr(b, e == std::string::npos ? std::string::npos : e - b);
  };
  if (name.rfind("routing.", 0) == 0) return name.substr(name.rfind('.') + 1);
  if (name.rfind("blocks.", 0) != 0) return "";
  std::string g = after(".rre.");
  return g.empty() ? after(".gate.") : g;
}

// Block index of blocks.L.* or routing.L.*.
inline int block_of(const std::string& name) {
  const size_t b = name.find('.') + 1;
  return std::stoi(name.substr(b, name.find('.', b) - b));
}

// The last component: w_in, b_in, w_out, b_out, w, ...
inline std::string leaf_of(const std::string& name) { return name.substr(name.rfind('.') + 1); }

}  // namespace sigma::surgery
