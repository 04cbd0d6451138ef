// Continuous batching (infer/batch_decoder.h, serve/engine.h): sequences of different lengths
// and domains decoded in one step give each sequence the logits and tokens it gets alone, with
// the KV cache or without it (the full forward pass over the prefix).
#include <gtest/gtest.h>

#include <cstring>
#include <map>

#include "infer/batch_decoder.h"
#include "infer/generate.h"
#include "serve/engine.h"

using namespace sigma;

namespace {

ModelConfig small_config(bool rre) {
  ModelConfig c;
  c.vocab = 31;
  c.d_model = 24;
  c.heads = 3;
  c.context = 24;
  c.layers = 3;
  c.slots = 2;
  c.init_std = 0.4f;  // sharp logits: a strict comparison
  c.domains = {{"a", "a", 0}, {"b", "b", 1}};
  if (rre) {
    c.rre_layers = 1;
    c.groups = {{"a", 2}, {"b", 3}};
  }
  c.validate();
  return c;
}

std::vector<int32_t> prompt_of(int len, int salt, int V) {
  std::vector<int32_t> p;
  for (int i = 0; i < len; ++i) p.push_back((5 * i + 3 * salt + 1) % V);
  return p;
}

// Three sequences start at different steps (one joins while the others decode) in slots that
// are not their index; each row's logits match its own KV-cache decoder at every step.
void check_rows_match_alone(bool rre) {
  const ModelConfig c = small_config(rre);
  Model m(c, 11);
  BatchDecoder dec(m, 4);
  struct Seq { int slot, domain, start; std::vector<int32_t> prompt; std::unique_ptr<KVCacheDecoder> alone; int32_t next = -1; };
  std::vector<Seq> seqs;
  seqs.push_back({2, 0, 0, prompt_of(5, 1, c.vocab), nullptr});
  seqs.push_back({0, 1, 0, prompt_of(1, 2, c.vocab), nullptr});
  seqs.push_back({3, 1, 3, prompt_of(9, 3, c.vocab), nullptr});  // joins at step 3
  for (int step = 0; step < 10; ++step) {
    std::vector<int> slots, domains;
    std::vector<int32_t> tokens;
    for (Seq& s : seqs) {
      if (step < s.start) continue;
      if (step == s.start) {
        s.alone = std::make_unique<KVCacheDecoder>(m, s.domain);
        const float* ref = nullptr;
        for (int32_t t : s.prompt) ref = s.alone->step(t);
        const float* got = dec.prefill(s.slot, s.domain, s.prompt);
        for (int v = 0; v < c.vocab; ++v) ASSERT_NEAR(got[v], ref[v], 2e-5) << "prefill";
        s.next = int32_t(std::max_element(got, got + c.vocab) - got);
        continue;
      }
      slots.push_back(s.slot);
      domains.push_back(s.domain);
      tokens.push_back(s.next);
    }
    if (slots.empty()) continue;
    dec.step(slots, domains, tokens);
    int row = 0;
    for (Seq& s : seqs) {
      if (step <= s.start) continue;
      const float* ref = s.alone->step(s.next);
      const float* got = dec.logits(row++);
      for (int v = 0; v < c.vocab; ++v)
        ASSERT_NEAR(got[v], ref[v], 2e-5) << "step " << step << " slot " << s.slot << " id " << v;
      EXPECT_EQ(dec.position(s.slot), s.alone->position());
      s.next = int32_t(std::max_element(got, got + c.vocab) - got);
    }
  }
}

}  // namespace

TEST(ServeDecode, RowsOfDifferentLengthsMatchTheirOwnDecoder) { check_rows_match_alone(false); }
TEST(ServeDecode, RowsMatchTheirOwnDecoderWithRandomRoutedExperts) { check_rows_match_alone(true); }

TEST(ServeDecode, PrefillScoresThePromptLikeTheFullForwardPass) {
  const ModelConfig c = small_config(true);
  Model m(c, 12);
  const auto p = prompt_of(c.context, 4, c.vocab);
  Batch b;
  b.resize(1, c.context);
  b.tokens = p;
  for (int t = 0; t + 1 < c.context; ++t) b.targets[size_t(t)] = p[size_t(t) + 1];
  b.domain[0] = 1;
  std::vector<float> loss(size_t(c.context));
  m.forward(b, loss.data());
  BatchDecoder dec(m, 2);
  std::vector<float> lp(p.size() - 1);
  dec.prefill(1, 1, p, lp.data());
  for (size_t t = 0; t + 1 < p.size(); ++t) EXPECT_NEAR(lp[t], -loss[t], 1e-4) << t;
  EXPECT_EQ(dec.position(1), c.context);
  EXPECT_EQ(dec.position(0), 0);  // the other row is untouched
  // score() takes an evaluation window of context + 1 tokens: every target of the window.
  auto window = p;
  window.push_back(7);
  b.targets[size_t(c.context) - 1] = 7;
  m.forward(b, loss.data());
  std::vector<float> all(size_t(c.context));
  dec.score(0, 1, window, all.data());
  for (int t = 0; t < c.context; ++t) EXPECT_NEAR(all[size_t(t)], -loss[size_t(t)], 1e-4) << t;
  EXPECT_EQ(dec.position(0), c.context);
  window.push_back(8);
  EXPECT_THROW(dec.score(0, 1, window, all.data()), Error);  // context + 2
  EXPECT_THROW(dec.step(std::vector<int>{1}, std::vector<int>{1}, std::vector<int32_t>{0}), Error);  // full
  EXPECT_THROW(dec.prefill(2, 0, p), Error);                                    // no slot 2
  EXPECT_THROW(dec.step(std::vector<int>{0, 0}, std::vector<int>{0, 0}, std::vector<int32_t>{1, 2}), Error);
}

// The engine's output for each request equals generate() of that request alone (with and
// without the KV cache), greedy and seeded, while other requests share its decode steps.
TEST(ServeEngine, BatchedOutputEqualsGenerateAlone) {
  const ModelConfig c = small_config(true);
  Model m(c, 13);
  struct Req { int domain; std::vector<int32_t> prompt; SamplingConfig s; };
  std::vector<Req> reqs;
  for (int i = 0; i < 7; ++i) {
    SamplingConfig s;
    s.max_new_tokens = 6 + i;
    if (i % 2) s = {0.9f, i % 3 == 0 ? 5 : 0, i == 5 ? 0.8f : 1.0f, 1.0f, uint64_t(100 + i), 6 + i, -1, 0.3f, 0.1f};
    reqs.push_back({i % 2, prompt_of(1 + 2 * i, i, c.vocab), s});
  }
  serve::Engine engine(m, 3, 16);  // 7 requests on 3 slots: most join while others decode
  std::vector<std::shared_ptr<serve::Channel>> chans;
  for (size_t i = 0; i < reqs.size(); ++i) {
    auto ch = std::make_shared<serve::Channel>(1);
    serve::Job j;
    j.domain = reqs[i].domain;
    j.prompt = reqs[i].prompt;
    j.s = reqs[i].s;
    j.out = ch;
    ASSERT_TRUE(engine.submit({j}));
    chans.push_back(ch);
  }
  for (size_t i = 0; i < reqs.size(); ++i) {
    std::vector<int32_t> got;
    std::string reason;
    while (reason.empty()) {
      auto e = chans[i]->pop(10000);
      ASSERT_TRUE(e.has_value()) << "request " << i << " timed out";
      if (e->finish_reason.empty()) got.push_back(e->token);
      else reason = e->finish_reason;
    }
    EXPECT_EQ(reason, "length");
    EXPECT_EQ(got, generate(m, reqs[i].domain, reqs[i].prompt, reqs[i].s, true)) << "request " << i;
    EXPECT_EQ(got, generate(m, reqs[i].domain, reqs[i].prompt, reqs[i].s, false)) << "request " << i;
  }
  const auto st = engine.stats();
  EXPECT_EQ(st.busy_slots, 0);
  EXPECT_GT(st.decode_tokens, st.decode_steps);  // some steps decoded several sequences
}

TEST(ServeEngine, FullQueueRefusesAndCancelledChoicesFreeTheirSlot) {
  ModelConfig c = small_config(false);
  c.context = 4096;  // a sequence that would run for thousands of steps unless cancelled
  Model m(c, 14);
  serve::Engine engine(m, 1, 2);
  auto hog = std::make_shared<serve::Channel>(1);
  serve::Job j;
  j.prompt = {1, 2};
  j.s.max_new_tokens = 4000;
  j.out = hog;
  ASSERT_TRUE(engine.submit({j}));
  ASSERT_TRUE(hog->pop(10000).has_value());  // running: the one slot is taken
  auto waiting = std::make_shared<serve::Channel>(2);
  serve::Job w = j;
  w.out = waiting;
  w.s.max_new_tokens = 2;
  serve::Job w2 = w;
  w2.index = 1;
  ASSERT_TRUE(engine.submit({w, w2}));
  serve::Job w3 = w;
  w3.out = std::make_shared<serve::Channel>(1);
  EXPECT_FALSE(engine.submit({w3}));  // the queue of 2 is full
  hog->cancelled[0] = true;           // the client left: its slot frees for the queue
  int tokens = 1;
  for (;;) {
    auto e = hog->pop(10000);
    ASSERT_TRUE(e.has_value());
    if (!e->finish_reason.empty()) {
      EXPECT_EQ(e->finish_reason, "stop");
      break;
    }
    ++tokens;
  }
  EXPECT_LT(tokens, 4000);
  int finished = 0;
  while (finished < 2) {
    auto ev = waiting->pop(10000);
    ASSERT_TRUE(ev.has_value()) << "the cancelled request kept its slot";
    finished += !ev->finish_reason.empty();
  }
  EXPECT_TRUE(engine.submit({w3}));
}

// An idle server takes `slots + queue` choices at once, even before its engine thread has moved
// the first ones into their slots (a burst used to find the free slots' choices still counted
// as waiting, and got 503 after one request); one more is refused.
TEST(ServeEngine, AnIdleEngineTakesSlotsPlusQueueChoicesAtOnce) {
  ModelConfig c = small_config(false);
  c.context = 4096;
  Model m(c, 14);
  serve::Engine engine(m, 2, 1);
  auto out = std::make_shared<serve::Channel>(3);
  std::vector<serve::Job> jobs(3);
  for (int i = 0; i < 3; ++i) {
    jobs[size_t(i)].prompt = {1, 2};
    jobs[size_t(i)].s.max_new_tokens = 4000;
    jobs[size_t(i)].index = i;
    jobs[size_t(i)].out = out;
  }
  ASSERT_TRUE(engine.submit(jobs)) << "2 free slots and a queue of 1 refused 3 choices";
  serve::Job extra = jobs[0];
  extra.index = 0;
  extra.out = std::make_shared<serve::Channel>(1);
  EXPECT_FALSE(engine.submit({extra}));  // whether or not the first two have their slots yet
  for (int i = 0; i < 3; ++i) out->cancelled[size_t(i)] = true;
  int finished = 0;
  while (finished < 3) {
    auto e = out->pop(10000);
    ASSERT_TRUE(e.has_value());
    finished += !e->finish_reason.empty();
  }
  EXPECT_TRUE(engine.submit({extra}));
}

// OpenAI's additive penalties: logit -= frequency * count + presence * (count > 0).
TEST(ServeSampling, FrequencyAndPresencePenaltiesFollowTheirDefinition) {
  std::vector<float> logits = {3.0f, 2.5f, 1.0f, 0.0f};
  SamplingConfig s;
  s.frequency_penalty = 0.5f;
  s.presence_penalty = 0.25f;
  // id 0 seen twice: 3 - 2 * 0.5 - 0.25 = 1.75; id 1 once: 2.5 - 0.5 - 0.25 = 1.75; id 2 unseen.
  sample_next(logits.data(), 4, {0, 0, 1}, s, 0);
  EXPECT_FLOAT_EQ(logits[0], 1.75f);
  EXPECT_FLOAT_EQ(logits[1], 1.75f);
  EXPECT_FLOAT_EQ(logits[2], 1.0f);
  std::vector<float> l2 = {3.0f, 2.5f, 1.0f, 0.0f};
  EXPECT_EQ(sample_next(l2.data(), 4, {0, 0, 0}, s, 0), 1);  // 3 - 1.5 - 0.25 = 1.25 < 2.5
  std::vector<float> l3 = {3.0f, 2.5f, 1.0f, 0.0f};
  s.frequency_penalty = -1.0f;  // negative values encourage repeats
  s.presence_penalty = 0.0f;
  EXPECT_EQ(sample_next(l3.data(), 4, {1}, s, 0), 1);  // 2.5 + 1 > 3
}

// The prefix cache: prompts sharing a prefix of full prefill chunks reuse its keys and values,
// and every token and log-probability is the same bits as with the cache off.
TEST(ServeEngine, PrefixCacheReusesSharedPrefixesWithTheSameBits) {
  ModelConfig c = small_config(true);
  c.context = 200;
  c.validate();
  Model m(c, 17);
  const std::vector<int32_t> shared = prompt_of(150, 3, c.vocab);  // two full chunks of 64
  struct Req { int domain; std::vector<int32_t> prompt; };
  std::vector<Req> reqs;
  for (int i = 0; i < 6; ++i) {
    std::vector<int32_t> p = shared;
    if (i == 4) p.resize(70);  // shares one chunk
    for (int t = 0; t < 3 + i; ++t) p.push_back((7 * t + i) % c.vocab);
    reqs.push_back({i == 5 ? 1 : 0, p});  // the last in another domain: nothing to reuse
  }
  auto run = [&](bool cache, int64_t* reused) {
    serve::Engine engine(m, 2, 16, nullptr, cache);
    std::vector<std::vector<std::pair<int32_t, double>>> out;
    for (const Req& r : reqs) {  // one at a time, so each finds the previous in the cache
      auto ch = std::make_shared<serve::Channel>(1);
      serve::Job j;
      j.domain = r.domain;
      j.prompt = r.prompt;
      j.s.max_new_tokens = 8;
      j.s.temperature = 0.8f;
      j.s.seed = 5;
      j.top_logprobs = 2;
      j.out = ch;
      EXPECT_TRUE(engine.submit({j}));
      std::vector<std::pair<int32_t, double>> got;
      for (;;) {
        auto e = ch->pop(10000);
        if (!e || !e->finish_reason.empty()) break;
        got.emplace_back(e->token, e->logprob);
        for (const auto& [id, lp] : e->top) got.emplace_back(id, lp);
      }
      out.push_back(got);
    }
    *reused = engine.stats().prefix_tokens_reused;
    return out;
  };
  int64_t with = 0, without = 0;
  const auto a = run(true, &with), b = run(false, &without);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(a[i].size(), b[i].size()) << "request " << i;
    for (size_t k = 0; k < a[i].size(); ++k) {
      EXPECT_EQ(a[i][k].first, b[i][k].first) << "request " << i;
      EXPECT_EQ(std::memcmp(&a[i][k].second, &b[i][k].second, sizeof(double)), 0) << "request " << i << " at " << k;
    }
  }
  EXPECT_EQ(without, 0);
  EXPECT_EQ(with, 3 * 128 + 64);  // requests 1-3 reuse two chunks, request 4 one, 0 and 5 none
}
