// The small two-domain model the training-step tests share (tests/test_train_step.cpp,
// tests/test_expert_parallel.cpp): 3 blocks, the top rre_layers of them RRE with groups of 3
// and 2 experts.
#pragma once
#include "model/config.h"

namespace sigma::testing {

inline ModelConfig step_config(int rre_layers) {
  ModelConfig c;
  c.vocab = 17;
  c.d_model = 16;
  c.heads = 2;
  c.context = 8;
  c.layers = 3;
  c.slots = 2;
  c.domains = {{"a", "a", 0}, {"b", "b", 1}};
  c.rre_layers = rre_layers;
  if (rre_layers) c.groups = {{"a", 3}, {"b", 2}};
  return c;
}

}  // namespace sigma::testing
