// Generation: the KV-cache decoder computes the same logits as the full forward pass, so both
// paths emit the same tokens, greedy and sampled.
#include <gtest/gtest.h>

#include <cmath>

#include "cli_util.h"
#include "infer/generate.h"

using namespace sigma;

static ModelConfig gen_config() {
  ModelConfig c;
  c.vocab = 29;
  c.d_model = 24;
  c.heads = 3;
  c.context = 20;
  c.layers = 3;
  c.slots = 2;
  c.init_std = 0.4f;  // sharp, varied logits: a stricter comparison than near-uniform ones
  c.domains = {{"a", "a", 0}, {"b", "b", 1}};
  return c;
}

TEST(Generate, CacheLogitsMatchFullForwardAtEveryPosition) {
  ModelConfig c = gen_config();
  Model m(c, 5);
  Batch b;
  b.resize(1, c.context);
  for (int t = 0; t < c.context; ++t) b.tokens[t] = (7 * t + 3) % c.vocab;
  b.domain[0] = 1;
  std::vector<float> loss(c.context);
  m.forward(b, loss.data());
  std::vector<float> full = m.logits();
  KVCacheDecoder dec(m, 1);
  for (int t = 0; t < c.context; ++t) {
    const float* l = dec.step(b.tokens[t]);
    for (int v = 0; v < c.vocab; ++v)
      ASSERT_NEAR(l[v], full[size_t(t) * c.vocab + v], 1e-4) << "position " << t << " id " << v;
  }
  EXPECT_THROW(dec.step(1), Error);  // past the context
}

TEST(Generate, SameTokensWithAndWithoutCache) {
  ModelConfig c = gen_config();
  Model m(c, 6);
  const std::vector<int32_t> prompt = {3, 14, 15, 9};
  std::vector<SamplingConfig> settings(4);
  settings[0].max_new_tokens = 16;  // greedy
  settings[1] = {1.0f, 0, 1.0f, 1.0f, 42, 16, -1};
  settings[2] = {0.8f, 5, 0.9f, 1.3f, 7, 16, -1};
  settings[3] = {1.0f, 0, 1.0f, 2.0f, 9, 16, -1};
  for (const auto& s : settings)
    for (int domain : {0, 1}) {
      auto with = generate(m, domain, prompt, s, true);
      auto without = generate(m, domain, prompt, s, false);
      EXPECT_EQ(with, without) << "temperature " << s.temperature << " domain " << domain;
      EXPECT_EQ(with.size(), 16u);
    }
}

TEST(Generate, SamplingIsSeededAndTopKOneIsGreedy) {
  ModelConfig c = gen_config();
  Model m(c, 7);
  const std::vector<int32_t> prompt = {1, 2};
  SamplingConfig s{1.0f, 0, 1.0f, 1.0f, 3, 12, -1};
  EXPECT_EQ(generate(m, 0, prompt, s), generate(m, 0, prompt, s));
  SamplingConfig other = s;
  other.seed = 4;
  EXPECT_NE(generate(m, 0, prompt, s), generate(m, 0, prompt, other));
  SamplingConfig greedy;
  greedy.max_new_tokens = 12;
  SamplingConfig k1 = s;
  k1.top_k = 1;
  EXPECT_EQ(generate(m, 0, prompt, greedy), generate(m, 0, prompt, k1));
}

TEST(Generate, RepetitionPenaltyAndNucleusFollowTheirDefinitions) {
  std::vector<float> logits = {2.0f, 1.0f, -1.0f, 0.5f};
  SamplingConfig s;
  s.repetition_penalty = 4.0f;
  // id 0 seen: 2.0 / 4 = 0.5 < 1.0, so greedy picks id 1; a negative seen logit is multiplied.
  EXPECT_EQ(sample_next(logits.data(), 4, {0, 2}, s, 0), 1);
  EXPECT_FLOAT_EQ(logits[0], 0.5f);
  EXPECT_FLOAT_EQ(logits[2], -4.0f);
  std::vector<float> peaked = {0.0f, 10.0f, 0.0f, 0.0f};
  SamplingConfig p{1.0f, 0, 0.5f, 1.0f, 0, 1, -1};
  for (uint64_t i = 0; i < 50; ++i) {
    auto l = peaked;
    EXPECT_EQ(sample_next(l.data(), 4, {}, p, i), 1);  // the top token alone holds > 50 %
  }
}

// The CLI says when generation ends at the model's context rather than at --max-new.
TEST(GenerateCli, SaysWhenItStopsAtTheContextLength) {
  sigma::testing::TempDir tmp("gen");
  auto r = sigma::testing::sigma_cmd(
      "train --quiet --set model.d_model=32 --set model.heads=2 --set model.context=16 "
      "--set train.batch=4 --set train.steps=2 --set train.eval_rows=4 --out " + tmp / "a");
  ASSERT_EQ(r.code, 0) << r.out;
  const std::string gen = "generate --ckpt " + tmp / "a/checkpoints --prompt '1 5 6 7' --domain copy ";
  r = sigma::testing::sigma_cmd(gen + "--max-new 40");
  ASSERT_EQ(r.code, 0) << r.out;
  // 4 prompt tokens + 13 new ones: the 13th is predicted at the 16th position, the last one.
  EXPECT_NE(r.out.find("stopped at the context length 16 after 13 new tokens (--max-new 40"),
            std::string::npos) << r.out;
  r = sigma::testing::sigma_cmd(gen + "--max-new 13");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(r.out.find("stopped"), std::string::npos) << r.out;
}

// --backend for the commands that read a checkpoint (issue 25): generate and eval run on the
// guard backend (device memory host code cannot touch) and print what the cpu backend prints,
// bit for bit, with strict checking of the memory handed to each op.
TEST(GenerateCli, GenerateAndEvalRunOnTheGuardBackendWithTheCpuBits) {
  sigma::testing::TempDir tmp("gen-guard");
  auto r = sigma::testing::sigma_cmd(
      "train --quiet --set model.d_model=32 --set model.heads=2 --set model.context=16 "
      "--set train.batch=4 --set train.steps=2 --set train.eval_rows=4 --out " + tmp / "a");
  ASSERT_EQ(r.code, 0) << r.out;
  const std::string gen = "generate --ckpt " + tmp / "a/checkpoints --prompt '1 5 6 7' --max-new 8 ";
  const std::string eval = "eval --json --ckpt " + tmp / "a/checkpoints ";
  for (const std::string& cmd : {gen, eval}) {
    auto stdout_of = [&](const std::string& env, const std::string& backend) {  // no timings
      return sigma::testing::run_cmd("(" + env + " " SIGMA_BINARY " " + cmd + "--backend " + backend +
                                     " 2>/dev/null)");
    };
    const auto cpu = stdout_of("", "cpu"), guard = stdout_of("SIGMA_GUARD_STRICT=1", "guard");
    ASSERT_EQ(cpu.code, 0) << cpu.out;
    ASSERT_EQ(guard.code, 0) << guard.out;
    EXPECT_EQ(cpu.out, guard.out) << cmd;
  }
  r = sigma::testing::sigma_cmd(gen + "--backend cuda");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("--backend"), std::string::npos) << r.out;
}
