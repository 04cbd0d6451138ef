// train.freeze: named parameter sets a run does not update (DESIGN §4, issue 6) — e.g. a new
// domain trained alone with everything else frozen, so that every other domain computes
// exactly what it did before.
#pragma once
#include <span>
#include <string>
#include <vector>

#include "model/batch.h"
#include "model/config.h"
#include "model/params.h"
#include "optim/adamw.h"

namespace sigma {

struct FreezePlan {
  UpdateMask mask;                    // over the model's ParamSet
  // Experts in a store (ECSS): frozen[(l - first_rre_block) * groups + g] for block l, group g.
  std::vector<uint8_t> frozen_experts;
  std::string summary;                // one line: what trains
};

// Selectors (any number):
//   shared      everything except what belongs to the trained domains alone: their groups'
//               experts and their embedding slots' rows. A frozen domain that shares a group or
//               a slot with a trained one would change, so that is an error naming both.
//   embeddings  embed.tokens and embed.positions
//   experts     every RRE expert
//   <prefix>    every tensor whose name starts with it (in-model names: blocks.2.rre.code.
//               names the code group's experts of block 2); it must match at least one tensor.
// `trained` are the model domains of the training data. `ps` is the model's ParamSet (without
// the expert tensors when they live in a store: external_experts).
FreezePlan plan_freeze(const std::vector<std::string>& selectors, const ModelConfig& cfg,
                       const ParamSet& ps, bool external_experts,
                       const std::vector<std::string>& trained);

// optim.sparse_embeddings: limits embed.tokens in `mask` (the plan's, copied per step) to the
// rows of the micro-batches' tokens, inputs and targets, in their domains' slots, updated
// lazily (one Adam step count per row), and within the rows the plan lets train.
void limit_to_batch_rows(UpdateMask& mask, const ParamSet& ps, const ModelConfig& cfg,
                         std::span<const Batch> micro);

}  // namespace sigma
