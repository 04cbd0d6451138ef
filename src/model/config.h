// Model shape and domain registry (DESIGN §1). One typed struct, validated once.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/options.h"

namespace sigma {

struct DomainSpec {
  std::string name;
  int group = 0;  // expert group (RRE blocks); ignored by a dense model
  int slot = 0;   // embedding slot: the domain's tokens read rows slot*V + id
};

struct ModelConfig {
  int vocab = 0;        // V; 0 = take it from the data (tokenizer or synthetic generator)
  int d_model = 64;     // d
  int heads = 4;        // h; d must divide by h
  int context = 64;     // T, positions in the learned tables
  int layers = 3;       // L blocks; the last one is the query layer
  int slots = 1;        // S embedding slots
  float init_std = 0.02f;
  std::vector<DomainSpec> domains;  // empty = taken from the data, all in group 0, slot 0

  int ffn() const { return 4 * d_model; }
  int head_dim() const { return d_model / heads; }
  int domain_index(const std::string& name) const;  // throws naming the known domains
  void validate() const;                            // throws naming the offending key
  void describe(Options& o, const std::string& prefix);
};

}  // namespace sigma
