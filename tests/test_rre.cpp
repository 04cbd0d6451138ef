// Random Routed Experts (DESIGN §2): routing tables, the RRE FFN's gradients (an expert without
// tokens gets exactly zero), domain isolation, dense mode bit-identical to the dense model,
// the KV-cache decoder, load statistics, checkpoints, `sigma inspect` and bad configs.
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "cli_util.h"
#include "gradcheck.h"
#include "infer/generate.h"
#include "model/model.h"
#include "model/names.h"
#include "test_util.h"
#include "model/routing.h"
#include "train/checkpoint.h"
#include "run/config.h"
#include "io/safetensors.h"

using namespace sigma;
using namespace sigma::testing;

namespace {

// Mixed model: block 0 dense, blocks 1-2 RRE (2 = the query layer); groups of different sizes,
// two domains sharing group g1 on different slots.
ModelConfig mixed_config() {
  ModelConfig c = tiny_config();
  c.rre_layers = 2;
  c.groups = {{"g1", 3}, {"g2", 2}};
  c.domains = {{"a", "g1", 0}, {"b", "g2", 1}, {"c", "g1", 1}};
  c.routing_seed = 17;
  return c;
}

const int32_t* table(const Model& m, int block, const std::string& group) {
  return m.buffers().at(names::routing(block, group)).value.data<int32_t>();
}

// Random tokens; rows whose domain is in group g1 avoid the ids that block 1 routes to g1's
// expert 0, so that expert receives no tokens.
Batch batch_without_expert(const Model& m, const std::vector<int>& domains, int T, uint64_t seed) {
  const ModelConfig& c = m.config();
  Batch b;
  b.resize(int(domains.size()), T);
  Rng r(seed, 1);
  const std::string idle = names::routing(1, "g1");
  const int32_t* t1 = m.buffers().contains(idle) ? table(m, 1, "g1") : nullptr;
  for (int row = 0; row < b.B; ++row) {
    b.domain[row] = domains[size_t(row)];
    const bool g1 = c.domains[size_t(b.domain[row])].group == "g1";
    for (int t = 0; t < T; ++t) {
      int32_t x;
      do x = int32_t(r.below(c.vocab));
      while (g1 && t1 && t1[x] == 0);
      b.tokens[size_t(row) * T + t] = x;
      b.targets[size_t(row) * T + t] = int32_t(r.below(c.vocab));
    }
  }
  b.mask[1] = 0.0f;
  return b;
}

bool all_zero(const Tensor& t, int64_t begin = 0, int64_t end = -1) {
  if (end < 0) end = t.numel();
  const std::vector<float> v = host_floats(t);
  for (int64_t i = begin; i < end; ++i)
    if (v[size_t(i)] != 0.0f) return false;
  return true;
}

template <class Fn>
void expect_error(Fn&& fn, const std::vector<std::string>& needles) {
  try {
    fn();
    ADD_FAILURE() << "no error; expected one mentioning " << needles.front();
  } catch (const Error& e) {
    for (const auto& n : needles)
      EXPECT_NE(std::string(e.what()).find(n), std::string::npos)
          << "expected '" << n << "' in: " << e.what();
  }
}

}  // namespace

// ---- routing tables ----

TEST(Routing, TablesAreDeterministicFromTheSeed) {
  EXPECT_EQ(random_routing_table(1000, 7, 5, 3, "code"), random_routing_table(1000, 7, 5, 3, "code"));
  EXPECT_NE(random_routing_table(1000, 7, 5, 3, "code"), random_routing_table(1000, 7, 6, 3, "code"));
  // The model's buffers are exactly these tables.
  ModelConfig c = mixed_config();
  Model m(c, 1);
  for (int l : {1, 2})
    for (const auto& g : c.groups) {
      const auto want = random_routing_table(c.vocab, g.experts, c.routing_seed, l, g.name);
      EXPECT_EQ(std::vector<int32_t>(table(m, l, g.name), table(m, l, g.name) + c.vocab), want)
          << names::routing(l, g.name);
    }
  EXPECT_FALSE(m.buffers().contains("routing.0.g1"));  // block 0 is dense
}

TEST(Routing, TablesAreIndependentAcrossBlocksAndGroups) {
  const int64_t V = 4096;
  const int K = 4;
  const auto a = random_routing_table(V, K, 1, 1, "g"), b = random_routing_table(V, K, 1, 2, "g"),
             c = random_routing_table(V, K, 1, 1, "h");
  for (const auto* other : {&b, &c}) {
    // Joint counts of (expert in a, expert in other): each cell near V/K^2 = 256 (sd ~ 14).
    std::vector<int> joint(K * K, 0);
    for (int64_t i = 0; i < V; ++i) ++joint[size_t(a[size_t(i)] * K + (*other)[size_t(i)])];
    for (int cell : joint) EXPECT_NEAR(cell, 256, 80);
  }
}

TEST(Routing, IdCountsBalancedWithinOne) {
  for (auto [V, K] : {std::pair<int64_t, int>{13, 3}, {1000, 7}, {32, 4}, {5, 8}, {50000, 16}, {9, 1}}) {
    const auto t = random_routing_table(V, K, 3, 0, "g");
    std::vector<int64_t> n(size_t(K), 0);
    for (int32_t e : t) {
      ASSERT_TRUE(e >= 0 && e < K);
      ++n[size_t(e)];
    }
    const auto [lo, hi] = std::minmax_element(n.begin(), n.end());
    EXPECT_EQ(*lo, V / K) << V << "/" << K;
    EXPECT_LE(*hi - *lo, 1) << V << "/" << K;
  }
}

TEST(Routing, FrequencyTablesBalanceZipfTokensBetterThanRandom) {
  const int64_t V = 2000;
  const int K = 8;
  std::vector<int64_t> counts(static_cast<size_t>(V), 0);
  for (int64_t i = 0; i < V; ++i) counts[size_t(i)] = int64_t(1e6 / double(i + 1));  // Zipf
  const auto freq = frequency_routing_table(counts, K, 1, 1, "g");
  EXPECT_EQ(freq, frequency_routing_table(counts, K, 1, 1, "g"));
  const double fi = expected_imbalance(freq, K, counts);
  const double ri = expected_imbalance(random_routing_table(V, K, 1, 1, "g"), K, counts);
  // The most frequent id alone holds 1e6 of ~8.2e6 tokens, more than a fair share (1.02e6)
  // can hide; greedy puts it alone and fills the rest evenly.
  EXPECT_LT(fi, ri);
  EXPECT_LT(fi, 1.05);
  // Zero-count ids still spread over the experts (ties: fewer ids first).
  std::vector<int64_t> zeros(static_cast<size_t>(V), 0);
  const auto z = frequency_routing_table(zeros, K, 1, 1, "g");
  std::vector<int> n(K, 0);
  for (int32_t e : z) ++n[size_t(e)];
  for (int x : n) EXPECT_EQ(x, V / K);
}

// ---- the RRE FFN ----

TEST(Rre, LossGradientMatchesFiniteDifferencesAndAnIdleExpertGetsExactlyZero) {
  ModelConfig c = mixed_config();
  Model m(c, 42);
  for (Param& p : m.params().all())  // non-trivial LayerNorm parameters and biases
    if (p.value.shape().size() == 1 || p.name.find("rre") != std::string::npos)
      if (p.value.shape().size() <= 2)
        edit_floats(p.value, [](float* v, int64_t n) { for (int64_t i = 0; i < n; ++i) v[i] += 0.2f * rng_normal(7, 3, i); });
  Batch b = batch_without_expert(m, {0, 1, 2}, 5, 1);
  std::vector<float> loss(b.tokens.size()), scale(b.mask);
  auto total = [&] {
    m.forward(b, loss.data());
    double s = 0;
    for (size_t i = 0; i < loss.size(); ++i) s += double(scale[i]) * loss[i];
    return s;
  };
  m.params().zero_grad();
  m.forward(b, loss.data(), scale.data());
  m.backward(b);
  // Block 1, group g1, expert 0 received no token: every gradient of it is exactly zero, and
  // so is the finite difference (the loss does not depend on it at all).
  ASSERT_EQ(m.expert_load()[0].tokens[0][0], 0);
  const int64_t d = c.d_model, f = c.ffn();
  for (auto [name, per] : {std::pair<const char*, int64_t>{"w_in", d * f}, {"b_in", f},
                           {"w_out", f * d}, {"b_out", d}}) {
    const Param& p = m.params().at(std::string("blocks.1.rre.g1.") + name);
    EXPECT_TRUE(all_zero(p.grad, 0, per)) << p.name;
    EXPECT_FALSE(all_zero(p.grad, per, p.grad.numel())) << p.name << ": other experts learn";
  }
  for (Param& p : m.params().all()) {
    const std::vector<float> an = host_floats(p.grad);
    std::vector<size_t> idx;
    const size_t n = p.value.numel();
    const size_t K = p.expert ? size_t(p.value.dim(0)) : 1, per = n / K;
    for (size_t e = 0; e < K; ++e) {  // a sample of every expert's slice
      const size_t stride = per > 40 ? per / 11 : 1;
      for (size_t i = 0; i < per; i += stride) idx.push_back(e * per + i);
    }
    expect_grad_matches(p.name, p.value, an, total, 1e-2, 2e-3, 2e-2, idx);
  }
}

TEST(Rre, DomainIsolation) {
  ModelConfig c = mixed_config();
  Model m(c, 3);
  const int64_t V = c.vocab, d = c.d_model;
  for (int dom : {0, 2}) {  // a: group g1 slot 0; c: group g1 slot 1
    Batch b = batch_without_expert(m, {dom, dom}, 6, 9);
    std::vector<float> loss(b.tokens.size()), scale(b.tokens.size(), 0.1f);
    m.params().zero_grad();
    m.forward(b, loss.data(), scale.data());
    m.backward(b);
    for (const Param& p : m.params().all()) {
      if (p.name.find(".rre.g2.") != std::string::npos) {
        EXPECT_TRUE(all_zero(p.grad)) << p.name;
      } else if (p.name.find(".rre.g1.") != std::string::npos) {
        EXPECT_FALSE(all_zero(p.grad)) << p.name;
      }
    }
    const Tensor& e = m.params().at("embed.tokens").grad;
    const int used = c.domains[size_t(dom)].slot, unused = 1 - used;
    EXPECT_TRUE(all_zero(e, unused * V * d, (unused + 1) * V * d)) << "slot " << unused;
    EXPECT_FALSE(all_zero(e, used * V * d, (used + 1) * V * d)) << "slot " << used;
  }
}

// Copies `dense`'s parameters into `sparse`, each expert of block l holding block l's dense FFN.
static void copy_dense_into_experts(const Model& dense, Model& sparse) {
  for (Param& p : sparse.params().all()) {
    std::string name = p.name;
    const size_t r = name.find(".rre.");
    if (r != std::string::npos)
      name = name.substr(0, r) + ".ffn." + name.substr(name.rfind('.') + 1);
    const Tensor& src = dense.params().at(name).value;
    const int64_t K = p.expert ? p.value.dim(0) : 1;
    ASSERT_EQ(src.numel() * K, p.value.numel()) << p.name;
    const std::vector<float> w = host_floats(src);
    for (int64_t e = 0; e < K; ++e) ops::upload(p.value, w.data(), src.nbytes(), size_t(e) * src.nbytes());
  }
}

struct Pass {
  std::vector<float> logits, loss;
};
static Pass run_pass(Model& m, const Batch& b) {
  const size_t N = b.tokens.size();
  Pass out;
  out.loss.resize(N);
  m.forward(b, out.loss.data());
  out.logits = m.logits();
  std::vector<float> scale(b.mask), loss(N);
  m.params().zero_grad();
  m.forward(b, loss.data(), scale.data());
  m.backward(b);
  return out;
}

TEST(Rre, DenseModeIsBitIdenticalToTheDenseModel) {
  ModelConfig dc = mixed_config();
  dc.rre_layers = 0;
  dc.groups.clear();
  Model dense(dc, 5);
  Batch b = batch_without_expert(dense, {0, 1, 2, 1}, 6, 4);  // (routes unused: dense)
  const Pass want = run_pass(dense, b);

  // N = 0 with groups declared: the same parameters, names and function.
  ModelConfig n0 = mixed_config();
  n0.rre_layers = 0;
  Model zero(n0, 5);
  ASSERT_EQ(zero.params().all().size(), dense.params().all().size());
  ASSERT_TRUE(zero.buffers().all().empty());

  // One group holding every domain, one expert: every block's FFN is the dense one.
  ModelConfig sc = mixed_config();
  sc.groups = {{"all", 1}};
  for (auto& dom : sc.domains) dom.group = "all";
  sc.rre_layers = 3;  // sparse mode: every block, query layer included
  Model sparse(sc, 99);
  copy_dense_into_experts(dense, sparse);
  const Pass got = run_pass(sparse, b);
  ASSERT_EQ(0, std::memcmp(want.logits.data(), got.logits.data(), want.logits.size() * 4));
  ASSERT_EQ(0, std::memcmp(want.loss.data(), got.loss.data(), want.loss.size() * 4));
  for (const Param& p : sparse.params().all()) {
    std::string name = p.name;
    const size_t r = name.find(".rre.");
    if (r != std::string::npos) name = name.substr(0, r) + ".ffn." + name.substr(name.rfind('.') + 1);
    const Tensor g = ops::to_host(dense.params().at(name).grad), h = ops::to_host(p.grad);
    EXPECT_EQ(0, std::memcmp(g.bytes(), h.bytes(), g.nbytes())) << p.name;
  }
}

TEST(Rre, OneExpertPerGroupComputesTheDenseFunction) {
  // Several groups of one expert each, all holding the dense FFN: the same function, but each
  // group's rows run as their own GEMM, and oneDNN does not promise the same rounding for a
  // row at every matrix height, so this compares with a tolerance (the experts' gradients
  // also split the dense one's sum by group).
  ModelConfig dc = mixed_config();
  dc.rre_layers = 0;
  dc.groups.clear();
  Model dense(dc, 5);
  ModelConfig sc = mixed_config();
  sc.groups = {{"g1", 1}, {"g2", 1}};
  Model sparse(sc, 99);
  copy_dense_into_experts(dense, sparse);
  Batch b = batch_without_expert(dense, {0, 1, 2, 1}, 6, 4);
  const Pass want = run_pass(dense, b), got = run_pass(sparse, b);
  for (size_t i = 0; i < want.logits.size(); ++i)
    ASSERT_NEAR(want.logits[i], got.logits[i], 1e-5 + 1e-5 * std::fabs(want.logits[i])) << i;
  auto near = [](const std::string& what, const float* a, const float* b1, const float* b2,
                 int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
      const float other = b2 ? b1[i] + b2[i] : b1[i];
      ASSERT_NEAR(a[i], other, 1e-5 + 1e-4 * std::fabs(a[i])) << what << "[" << i << "]";
    }
  };
  for (const Param& p : dense.params().all()) {
    if (sparse.params().contains(p.name)) {
      near(p.name, host_floats(p.grad).data(), host_floats(sparse.params().at(p.name).grad).data(),
           nullptr, p.grad.numel());
      continue;
    }
    const std::string base = p.name.substr(0, p.name.find(".ffn.")),
                      leaf = p.name.substr(p.name.rfind('.'));
    near(p.name, host_floats(p.grad).data(), host_floats(sparse.params().at(base + ".rre.g1" + leaf).grad).data(),
         host_floats(sparse.params().at(base + ".rre.g2" + leaf).grad).data(), p.grad.numel());
  }
}

TEST(Rre, KVCacheDecoderRoutesLikeTheFullForward) {
  ModelConfig c = mixed_config();
  c.context = 12;
  c.init_std = 0.4f;
  Model m(c, 5);
  for (int dom : {0, 1, 2}) {
    Batch b;
    b.resize(1, c.context);
    for (int t = 0; t < c.context; ++t) b.tokens[size_t(t)] = (5 * t + 3 + dom) % c.vocab;
    b.domain[0] = dom;
    std::vector<float> loss(size_t(c.context));
    m.forward(b, loss.data());
    std::vector<float> full = m.logits();
    KVCacheDecoder dec(m, dom);
    for (int t = 0; t < c.context; ++t) {
      const float* l = dec.step(b.tokens[size_t(t)]);
      for (int v = 0; v < c.vocab; ++v)
        ASSERT_NEAR(l[v], full[size_t(t) * c.vocab + v], 1e-4) << "domain " << dom << " position " << t;
    }
  }
}

TEST(Rre, ExpertLoadCountsTokensPerExpert) {
  ModelConfig c = mixed_config();
  Model m(c, 2);
  Batch b = batch_without_expert(m, {0, 1, 2}, 6, 3);
  std::vector<float> loss(b.tokens.size());
  m.reset_expert_load();
  m.forward(b, loss.data());
  m.forward(b, loss.data());
  ASSERT_EQ(m.expert_load().size(), 2u);
  for (const BlockLoad& bl : m.expert_load()) {
    std::vector<std::vector<int64_t>> want = {std::vector<int64_t>(3, 0), std::vector<int64_t>(2, 0)};
    for (int row = 0; row < b.B; ++row) {
      const int g = m.domain_group(b.domain[size_t(row)]);
      for (int t = 0; t < b.T; ++t)
        want[size_t(g)][size_t(table(m, bl.block, c.groups[size_t(g)].name)[b.tokens[size_t(row) * b.T + t]])] += 2;
    }
    EXPECT_EQ(bl.tokens, want) << "block " << bl.block;
  }
  // The active set known before the forward pass is exactly the experts that got tokens.
  const auto active = m.active_experts(b);
  ASSERT_EQ(active.size(), 2u);
  for (size_t i = 0; i < active.size(); ++i) {
    std::vector<int> loaded;
    int e = 0;
    for (const auto& g : m.expert_load()[i].tokens)
      for (int64_t n : g) {
        if (n > 0) loaded.push_back(e);
        ++e;
      }
    EXPECT_EQ(active[i], loaded) << "block " << m.expert_load()[i].block;
  }
  EXPECT_EQ(std::count(active[0].begin(), active[0].end(), 0), 0);  // g1's idle expert
  BlockLoad hand{1, {{3, 1}, {0, 0, 0}, {2, 2}}};
  EXPECT_DOUBLE_EQ(hand.imbalance(), 1.5);  // group 0: max 3, mean 2
  m.reset_expert_load();
  EXPECT_EQ(m.expert_load()[0].tokens[0][1], 0);
}

// ---- configs and checkpoints ----

TEST(RreConfig, BadConfigsAreErrorsNamingTheKey) {
  auto load = [](const char* text) {
    Config cfg;
    cfg.apply(nlohmann::json::parse(text), "test.json");
    cfg.model.vocab = 32;
    cfg.model.validate();
  };
  const char* base_groups = R"("groups": [{"name": "g", "experts": 2}])";
  expect_error([&] { load((std::string(R"({"model": {)") + base_groups +
                           R"(, "domains": [{"name": "a", "group": "h"}]}})").c_str()); },
               {"model.domains", "'a'", "group 'h'", "declared: g"});
  expect_error([&] { load(R"({"model": {"groups": [{"name": "g", "experts": 0}]}})"); },
               {"model.groups", "'g'", "experts"});
  expect_error([&] { load((std::string(R"({"model": {)") + base_groups +
                           R"(, "domains": [{"name": "a", "group": "g", "slot": 2}]}})").c_str()); },
               {"model.domains", "'a'", "slot 2", "model.slots"});
  expect_error([&] { load(R"({"model": {"domains": [{"name": "a", "group": 1}]}})"); },
               {"model.domains", "'group' must be"});
  expect_error([&] { load(R"({"model": {"groups": [{"name": "g", "size": 2}]}})"); },
               {"model.groups", "unknown field 'size'"});
  expect_error([&] { load(R"({"model": {"rre_layers": 4, "domains": [{"name": "g"}]}})"); },
               {"model.rre_layers"});
  expect_error([&] { load(R"({"model": {"groups": [], "domains": [{"name": "a"}]}})"); },
               {"model.rre_layers", "model.groups is empty"});
  expect_error([&] { load(R"({"model": {"groups": [{"name": "a.b"}], "domains": [{"name": "a.b"}]}})"); },
               {"model.groups", "'a.b'"});
  expect_error([&] { load(R"({"model": {"groups": [{"name": "g"}, {"name": "g"}], "domains": [{"name": "g"}]}})"); },
               {"model.groups", "declared twice"});
  expect_error([&] { load(R"({"model": {"routing": "learned"}})"); }, {"model.routing", "random"});
  // The C++ side: a group of zero experts.
  ModelConfig c = mixed_config();
  c.groups[1].experts = 0;
  expect_error([&] { c.validate(); }, {"model.groups", "'g2'", "0 experts"});
}

TEST(RreConfig, MainJobIsAMixedModelWithOneGroupPerSyntheticDomain) {
  Config cfg;
  EXPECT_GT(cfg.model.rre_layers, 0);
  EXPECT_LT(cfg.model.rre_layers, cfg.model.layers);
  std::set<int> sizes;
  for (const auto& g : cfg.model.groups) sizes.insert(g.experts);
  EXPECT_EQ(cfg.model.groups.size(), 3u);
  EXPECT_GT(sizes.size(), 1u) << "groups of different sizes";
  // Round trip through the JSON stored in checkpoints.
  Config back;
  back.apply(cfg.to_json(), "round trip");
  EXPECT_EQ(back.to_json(), cfg.to_json());
}

class RreCheckpoint : public ::testing::Test {
 protected:
  // Writes model.safetensors of `m` into dir, with `table` replacing routing.1.g1.
  void write_model(const Model& m, const std::string& dir, const Tensor* table) {
    std::filesystem::create_directories(dir);
    std::vector<TensorRef> refs;
    std::vector<Tensor> host;  // the parameters' host copies (they live on the device)
    host.reserve(m.params().all().size());
    for (const Param& p : m.params().all()) refs.push_back(tensor_ref(p.name, host.emplace_back(ops::to_host(p.value))));
    for (const Buffer& b : m.buffers().all())
      refs.push_back(tensor_ref(b.name, (table && b.name == "routing.1.g1") ? *table : b.value));
    write_safetensors(dir + "/model.safetensors", refs, {{"format", "sigma-model"}});
  }
  TempDir tmp{"rre-ckpt"};
};

TEST_F(RreCheckpoint, RoutingTablesRoundTripAndBadTablesNameTheKey) {
  ModelConfig c = mixed_config();
  Model m(c, 1);
  write_model(m, tmp / "ok", nullptr);
  ModelConfig other = c;
  other.routing_seed = 99;  // different tables until loaded
  Model back(other, 1);
  load_model(back, tmp / "ok");
  for (const Buffer& b : m.buffers().all())
    EXPECT_EQ(0, std::memcmp(b.value.bytes(), back.buffers().at(b.name).value.bytes(),
                             b.value.nbytes())) << b.name;

  Tensor short_table(DType::I32, {c.vocab - 1});
  write_model(m, tmp / "short", &short_table);
  expect_error([&] { load_model(back, tmp / "short"); },
               {"model.safetensors", "routing.1.g1", "[12]", "model.vocab = 13"});
  Tensor wrong(DType::I32, {c.vocab});
  wrong.data<int32_t>()[4] = 3;  // g1 has experts 0..2
  write_model(m, tmp / "range", &wrong);
  expect_error([&] { load_model(back, tmp / "range"); }, {"routing.1.g1", "token id 4", "expert 3"});

  // Frequency routing without counts: no forward until a checkpoint supplies the tables.
  ModelConfig fc = c;
  fc.routing = "frequency";
  Model freq(fc, 1);
  Batch b = batch_without_expert(m, {0}, 4, 1);
  std::vector<float> loss(4);
  expect_error([&] { freq.forward(b, loss.data()); }, {"routing.1.g1", "frequency"});
  load_model(freq, tmp / "ok");
  freq.forward(b, loss.data());
}

TEST(RreCli, TrainSavesTablesAndInspectDescribesTheCheckpoint) {
  TempDir tmp("rre-cli");
  const std::string tiny =
      "--set model.d_model=16 --set model.heads=2 --set model.context=8 --set train.batch=6 "
      "--set train.log_every=2 --set train.eval_rows=6 --set train.steps=4 ";
  auto r = sigma_cmd("train --quiet " + tiny + "--out " + tmp / "o");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("expert load"), std::string::npos) << r.out;
  // metrics.jsonl: tokens per expert and imbalance per RRE block, for every logging window.
  std::ifstream metrics(tmp / "o/metrics.jsonl");
  std::string line;
  int records = 0;
  while (std::getline(metrics, line)) {
    auto j = nlohmann::json::parse(line);
    ++records;
    ASSERT_TRUE(j.contains("expert_load") && j.contains("load_imbalance")) << line;
    int64_t total = 0;
    for (const auto& [block, groups] : j["expert_load"].items())
      for (const auto& [g, experts] : groups.items())
        for (const auto& n : experts) total += n.get<int64_t>();
    EXPECT_EQ(total, 2 * 2 * 6 * 8) << "2 RRE blocks x 2 steps x 6 rows x 8 tokens";
    EXPECT_GE(j["load_imbalance"]["1"].get<double>(), 1.0);
  }
  EXPECT_EQ(records, 2);

  r = sigma_cmd("inspect --json --ckpt " + tmp / "o/checkpoints");
  ASSERT_EQ(r.code, 0) << r.out;
  auto j = nlohmann::json::parse(r.out);
  CheckpointInfo info;
  auto m = load_checkpoint_model(tmp / "o/checkpoints", &info);
  const ModelConfig& c = m->config();
  EXPECT_EQ(j["parameters"]["total"].get<int64_t>(), m->params().numel());
  // Active per token: all but the experts, one expert per RRE block.
  const int64_t d = 16, f = 64, V = c.vocab, per_expert = 2 * d * f + f + d;
  int64_t experts = 0;
  for (const auto& g : c.groups) experts += g.experts;
  EXPECT_EQ(j["parameters"]["per_expert"].get<int64_t>(), per_expert);
  EXPECT_EQ(j["parameters"]["active_per_token"].get<int64_t>(),
            m->params().numel() - int64_t(c.rre_layers) * (experts - 1) * per_expert -
                int64_t(c.slots - 1) * V * d);
  ASSERT_EQ(j["groups"].size(), 3u);
  EXPECT_EQ(j["groups"][1]["name"], "copy");
  EXPECT_EQ(j["groups"][1]["experts"], 3);
  EXPECT_EQ(j["groups"][1]["domains"], nlohmann::json::array({"copy"}));
  ASSERT_EQ(j["tables"].size(), size_t(c.rre_layers) * 3);
  for (const auto& t : j["tables"]) EXPECT_LE(t["max"].get<int>() - t["min"].get<int>(), 1) << t;
  // The saved tables are the seeded ones.
  for (const Buffer& b : m->buffers().all()) {
    const int l = std::stoi(b.name.substr(8));
    const std::string g = b.name.substr(b.name.rfind('.') + 1);
    const auto want = random_routing_table(V, c.groups[size_t(c.group_index(g))].experts,
                                           c.routing_seed, l, g);
    EXPECT_EQ(0, std::memcmp(want.data(), b.value.bytes(), b.value.nbytes())) << b.name;
  }
  r = sigma_cmd("inspect --ckpt " + tmp / "o/checkpoints");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("active per token"), std::string::npos) << r.out;
}
