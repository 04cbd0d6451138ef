// The decode tests' model and helpers (tests/test_decode.cpp, tests/test_int8.cpp).
#pragma once
#include <cstdint>
#include <vector>

#include "infer/generate.h"
#include "model/model.h"

namespace sigma::testing {

// A sparse model with every kind of weight a decode step reads: dense and RRE blocks, the
// query layer, two embedding slots.
inline ModelConfig decode_config(int64_t d = 32) {
  ModelConfig c;
  c.vocab = 37;
  c.d_model = d;
  c.heads = 4;
  c.context = 24;
  c.layers = 3;
  c.rre_layers = 2;
  c.slots = 2;
  c.init_std = 0.3f;
  c.groups = {{"g0", 2}, {"g1", 3}};
  c.domains = {{"a", "g0", 0}, {"b", "g1", 1}};
  return c;
}

// Logits of every position of `tokens` decoded one token at a time through the KV cache.
inline std::vector<float> cached_logits(Model& m, int domain, const std::vector<int32_t>& tokens) {
  KVCacheDecoder dec(m, domain);
  std::vector<float> out;
  for (int32_t t : tokens) {
    const float* l = dec.step(t);
    out.insert(out.end(), l, l + m.config().vocab);
  }
  return out;
}

// n token ids spread over the vocabulary.
inline std::vector<int32_t> some_tokens(const ModelConfig& c, int n) {
  std::vector<int32_t> t;
  for (int i = 0; i < n; ++i) t.push_back((11 * i + 5) % c.vocab);
  return t;
}
}  // namespace sigma::testing
