#pragma once
#include <cstdint>
#include <vector>

namespace sigma {

// One micro-batch of B rows of T positions. Row b belongs to domain `domain[b]` (an index into
// ModelConfig::domains). mask[i] = 1 where target i is scored, 0 on padding / prompts.
struct Batch {
  int B = 0, T = 0;
  std::vector<int32_t> tokens;   // [B*T] inputs
  std::vector<int32_t> targets;  // [B*T] next tokens
  std::vector<float> mask;       // [B*T]
  std::vector<int32_t> domain;   // [B]

  void resize(int b, int t) {
    B = b;
    T = t;
    tokens.assign(size_t(b) * t, 0);
    targets.assign(size_t(b) * t, 0);
    mask.assign(size_t(b) * t, 1.0f);
    domain.assign(size_t(b), 0);
  }
};

}  // namespace sigma
