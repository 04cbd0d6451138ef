// The decode tests' model and helpers (tests/test_decode.cpp, tests/test_int8.cpp).
#pragma once
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "avx512_where.h"
#include "infer/generate.h"
#include "kernels/cpu/gemv.h"
#include "model/model.h"

namespace sigma::testing {

// Calls check(isa) for each SIMD path of the GEMVs (cpu::kGemvSimdIsas) this CPU can run, and
// says in the test's output which ran and which were skipped (by name); skips the test where
// none could run.
template <class Check>
void for_each_simd_isa(Check&& check) {
  std::string ran, skipped;
  for (cpu::GemvIsa isa : cpu::kGemvSimdIsas) {
    std::string& list = cpu::gemv_isa_available(isa) ? ran : skipped;
    list += std::string(list.empty() ? "" : ", ") + cpu::gemv_isa_name(isa);
    if (cpu::gemv_isa_available(isa)) check(isa);
  }
  std::printf("SIMD paths compared with the portable path%s: %s; skipped (not on this CPU): %s\n",
              sigma::testing::kAvx512Where,
              ran.empty() ? "none" : ran.c_str(), skipped.empty() ? "none" : skipped.c_str());
  ::testing::Test::RecordProperty("simd_paths_run", ran);
  ::testing::Test::RecordProperty("simd_paths_skipped", skipped);
  if (ran.empty()) GTEST_SKIP() << "this CPU has none of the SIMD paths (" << skipped << ")";
}

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

// Four sequences decoded together in one BatchDecoder of 4 slots and each alone in its own: for
// `steps` steps every slot's logits must equal its lone run's, bit for bit (docs/serving.md).
inline void expect_steps_batch_invariant(Model& m, int steps, const std::string& label) {
  const int64_t vocab = m.config().vocab;
  const std::vector<std::vector<int32_t>> prompts = {{1, 2, 3}, {4, 5}, {6, 7, 8, 9, 10, 11}, {12}};
  const std::vector<int> domains = {0, 1, 1, 0}, slots = {0, 1, 2, 3};
  BatchDecoder together(m, 4);
  std::vector<std::unique_ptr<BatchDecoder>> alone;
  std::vector<int32_t> next(4);
  for (int s = 0; s < 4; ++s) {
    together.prefill(s, domains[size_t(s)], prompts[size_t(s)]);
    alone.push_back(std::make_unique<BatchDecoder>(m, 1));
    alone.back()->prefill(0, domains[size_t(s)], prompts[size_t(s)]);
    next[size_t(s)] = int32_t((5 * s + 1) % vocab);
  }
  for (int step = 0; step < steps; ++step) {
    together.step(slots, domains, next);
    for (int s = 0; s < 4; ++s) {
      const int zero = 0;
      alone[size_t(s)]->step({&zero, 1}, {&domains[size_t(s)], 1}, {&next[size_t(s)], 1});
      EXPECT_EQ(0, std::memcmp(together.logits(s), alone[size_t(s)]->logits(0), size_t(vocab) * 4))
          << label << " step " << step << " slot " << s;
      next[size_t(s)] = int32_t((next[size_t(s)] * 7 + step) % vocab);
    }
  }
}
}  // namespace sigma::testing
