// Model shape, expert groups and domains (DESIGN §1-§2). One typed struct, validated once.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/options.h"
#include "model/domains.h"

namespace sigma {

// An expert group (DESIGN §2): every RRE block holds `experts` FFN experts for it.
struct GroupSpec {
  std::string name;  // used in tensor names: letters, digits, '_' and '-'
  int experts = 1;   // K_g
};

struct ModelConfig {
  int vocab = 0;        // V; 0 = take it from the data (tokenizer or synthetic generator)
  int d_model = 64;     // d
  int heads = 4;        // h; d must divide by h
  int context = 64;     // T, positions in the learned tables
  int layers = 3;       // L blocks; the last one is the query layer
  int slots = 1;        // S embedding slots
  float init_std = 0.02f;
  DomainRegistry domains;  // empty = taken from the data (group = the domain's name)
  // Random Routed Experts: the top `rre_layers` blocks (query layer included) have one FFN
  // expert per (group, expert); 0 = a dense model.
  int rre_layers = 0;
  std::vector<GroupSpec> groups;
  uint64_t routing_seed = 1;        // seeds the routing tables (independent of train.seed)
  std::string routing = "random";   // "random" | "frequency" (needs token counts per group)
  // How an expert block picks experts inside the group: "rre" (the routing tables) or the
  // learned-gate baseline "top1" (Switch) / "top2" (GShard), with a capacity limit and a
  // load-balancing loss (src/model/gate.h).
  std::string router = "rre";
  float capacity_factor = 1.25f;    // gate: each expert takes <= cf * k * rows / K rows
  float aux_loss_weight = 0.01f;    // gate: weight of the load-balancing loss per block

  int ffn() const { return 4 * d_model; }
  int head_dim() const { return d_model / heads; }
  int first_rre_block() const { return layers - rre_layers; }
  bool gated() const { return router != "rre"; }
  int experts_per_token() const { return router == "top2" ? 2 : 1; }
  bool is_rre_block(int l) const { return l >= first_rre_block(); }
  int domain_index(const std::string& name) const;  // throws naming the known domains
  int group_index(const std::string& name) const;   // throws naming the declared groups
  void validate() const;                            // throws naming the offending key
  void describe(Options& o, const std::string& prefix);
};

}  // namespace sigma
