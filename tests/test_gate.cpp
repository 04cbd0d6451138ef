// The learned-gate baseline (src/model/gate.h): gradients through the gate and the
// load-balancing loss by finite differences, the loss and the capacity drops on a case worked
// by hand, and the KV-cache decoder on a gated model.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>

#include "cli_util.h"
#include "gradcheck.h"
#include "infer/generate.h"
#include "kernels/ops.h"
#include "model/gate.h"
#include "model/model.h"
#include "test_util.h"

using namespace sigma;
using namespace sigma::testing;

namespace {

ModelConfig gated_config(const char* router) {
  ModelConfig c = tiny_config();
  c.rre_layers = 2;
  c.groups = {{"g1", 3}, {"g2", 2}};
  c.domains = {{"a", "g1", 0}, {"b", "g2", 1}, {"c", "g1", 1}};
  c.router = router;
  c.capacity_factor = 100.0f;  // nothing dropped: the loss is smooth in every parameter
  c.aux_loss_weight = 0.5f;    // large, so its gradient is visible next to the token loss
  return c;
}

Batch random_batch(const ModelConfig& c, std::vector<int> domains, int T, uint64_t seed) {
  Batch b;
  b.resize(int(domains.size()), T);
  Rng r(seed, 1);
  for (auto& t : b.tokens) t = int32_t(r.below(c.vocab));
  for (auto& t : b.targets) t = int32_t(r.below(c.vocab));
  for (size_t i = 0; i < domains.size(); ++i) b.domain[i] = domains[i];
  b.mask[1] = 0.0f;
  return b;
}

}  // namespace

class GateGradient : public ::testing::TestWithParam<const char*> {};

TEST_P(GateGradient, MatchesFiniteDifferencesThroughGateAndAuxLoss) {
  ModelConfig c = gated_config(GetParam());
  Model m(c, 11);
  for (Param& p : m.params().all())
    if (p.value.shape().size() == 1)
      edit_floats(p.value, [](float* v, int64_t n) { for (int64_t i = 0; i < n; ++i) v[i] += 0.2f * rng_normal(7, 3, i); });
  Batch b = random_batch(c, {0, 1, 2}, 5, 1);
  std::vector<float> loss(b.tokens.size()), scale(b.mask);
  double scale_sum = 0;
  for (float s : scale) scale_sum += s;
  auto total = [&] {
    m.forward(b, loss.data());
    double s = 0;
    for (size_t i = 0; i < loss.size(); ++i) s += double(scale[i]) * loss[i];
    return s + scale_sum * m.aux_loss();
  };
  m.params().zero_grad();
  m.forward(b, loss.data(), scale.data());
  m.backward(b);
  EXPECT_GT(m.aux_loss(), 0.0);
  for (const BlockLoad& l : m.expert_load()) EXPECT_EQ(l.dropped, 0);
  for (Param& p : m.params().all()) {
    const std::vector<float> an = host_floats(p.grad);
    std::vector<size_t> idx;
    const size_t n = p.value.numel(), stride = n > 40 ? n / 29 : 1;
    for (size_t i = 0; i < n; i += stride) idx.push_back(i);
    // A small step: a larger one could flip a top-k choice.
    expect_grad_matches(p.name, p.value, an, total, 2e-3, 3e-3, 3e-2, idx);
  }
  // The gates received gradient from both the combine weights and the aux loss.
  for (const char* g : {"blocks.1.gate.g1.w", "blocks.2.gate.g2.w"}) {
    double norm = 0;
    for (float v : host_floats(m.params().at(g).grad)) norm += std::fabs(v);
    EXPECT_GT(norm, 0.0) << g;
  }
}

INSTANTIATE_TEST_SUITE_P(TopK, GateGradient, ::testing::Values("top1", "top2"));

// One group of two experts over d = 2, gate W = I, rows chosen so p is (3/4, 1/4) or (1/4, 3/4).
TEST(Gate, AuxLossAndCapacityDropsOnAHandWorkedCase) {
  const int64_t N = 4, d = 2, f = 3;
  const float l3 = std::log(3.0f);
  const std::vector<float> x = {l3, 0, 0, l3, l3, 0, l3, 0};
  std::vector<float> gw = {1, 0, 0, 1};  // [d, K]
  std::vector<float> gw_grad(4, 0.0f);
  // Expert e: w_in = (e+1) * 0.1 everywhere, w_out = 0.2, biases 0.
  std::vector<float> w_in(2 * d * f), b_in(2 * f, 0.0f), w_out(2 * f * d), b_out(2 * d, 0.0f);
  for (int e = 0; e < 2; ++e) {
    std::fill_n(w_in.begin() + e * d * f, d * f, 0.1f * (e + 1));
    std::fill_n(w_out.begin() + e * f * d, f * d, 0.2f);
  }
  RreWeights w;
  w.offset = {0, 2};
  w.table = {nullptr};
  for (int e = 0; e < 2; ++e) {
    w.expert.push_back({{.v = w_in.data() + e * d * f}, b_in.data() + e * f,
                        {.v = w_out.data() + e * f * d}, b_out.data() + e * d});
    w.expert_grad.push_back({nullptr, nullptr, nullptr, nullptr});
  }
  const std::vector<PV> gate = {{gw.data(), gw_grad.data()}};
  const std::vector<int32_t> group(N, 0);
  std::vector<float> y(N * d, 0.0f), yg(2 * N * d), pre(2 * N * f), act(2 * N * f), gx(2 * N * d),
      z(N * 2), scratch(4 * N * d);
  GatePlan p;
  // Top-1, capacity 1.0: C = ceil(1 * 4 / 2) = 2; first choices are experts 0, 1, 0, 0, so
  // row 3 does not fit. f = (3/4, 1/4), P = (5/8, 3/8): aux = 2 (3/4 * 5/8 + 1/4 * 3/8) = 9/8.
  gate_forward(y.data(), yg.data(), pre.data(), act.data(), gx.data(), scratch.data(), z.data(), p, x.data(), w,
               gate, group.data(), 1, 1.0f, N, d, f);
  EXPECT_NEAR(ops::to_host(p.probs).f()[0], 0.75f, 1e-6);
  EXPECT_NEAR(p.aux, 9.0 / 8.0, 1e-6);
  EXPECT_EQ(p.dropped, 1);
  EXPECT_EQ(p.assigned, 3);
  EXPECT_EQ(p.pos[3 * 2], -1);
  EXPECT_EQ(y[6], 0.0f);  // the dropped row gets nothing from the experts
  EXPECT_EQ(y[7], 0.0f);
  // Row 0 through expert 0, scaled by p = 3/4: pre = 0.1 * ln3 per unit, then FastGelu, then
  // 0.2 * sum over f.
  const float h = 0.1f * l3, gelu = h / (1.0f + std::exp(-1.702f * h));
  EXPECT_NEAR(y[0], 0.75f * 0.2f * f * gelu, 1e-6);
  // Top-2 with the same factor: C = ceil(2 * 4 / 2) = 4, everything fits, and the combine
  // weights of each row sum to one.
  std::fill(y.begin(), y.end(), 0.0f);
  gate_forward(y.data(), yg.data(), pre.data(), act.data(), gx.data(), scratch.data(), z.data(), p, x.data(), w,
               gate, group.data(), 2, 1.0f, N, d, f);
  EXPECT_EQ(p.dropped, 0);
  EXPECT_EQ(p.assigned, 8);
  const Tensor gates = ops::to_host(p.gate);
  EXPECT_NEAR(gates.f()[0] + gates.f()[1], 1.0f, 1e-6);
  EXPECT_NEAR(p.aux, 9.0 / 8.0, 1e-6);  // the aux loss counts first choices only
  // Capacity 0.5, top-2: C = 2 per expert; first choices take 0, 1, 0 (row 3's first choice,
  // expert 0, is full) and second choices fill expert 1's last place: 4 dropped.
  gate_forward(y.data(), yg.data(), pre.data(), act.data(), gx.data(), scratch.data(), z.data(), p, x.data(), w,
               gate, group.data(), 2, 0.5f, N, d, f);
  EXPECT_EQ(p.assigned, 4);
  EXPECT_EQ(p.dropped, 4);
}

TEST(Gate, ModelCountsDropsPerBlock) {
  ModelConfig c = gated_config("top1");
  c.capacity_factor = 0.5f;  // at most half the rows fit
  Model m(c, 3);
  Batch b = random_batch(c, {0, 1, 2, 0}, 6, 2);
  std::vector<float> loss(b.tokens.size());
  m.reset_expert_load();
  m.forward(b, loss.data());
  for (const BlockLoad& l : m.expert_load()) {
    int64_t kept = 0;
    for (const auto& g : l.tokens)
      for (int64_t n : g) kept += n;
    EXPECT_EQ(kept + l.dropped, 24) << "block " << l.block;
    // g1 has 18 rows over 3 experts of capacity ceil(0.5 * 18 / 3) = 3; g2 has 6 rows over 2
    // experts of capacity ceil(0.5 * 6 / 2) = 2.
    EXPECT_LE(kept, 3 * 3 + 2 * 2) << "block " << l.block;
    EXPECT_GT(l.dropped, 0) << "block " << l.block;
  }
}

TEST(Gate, KVCacheDecoderMatchesTheFullForward) {
  for (const char* router : {"top1", "top2"}) {
    ModelConfig c = gated_config(router);
    c.context = 10;
    Model m(c, 5);
    for (int dom : {0, 1}) {
      Batch b;
      b.resize(1, c.context);
      for (int t = 0; t < c.context; ++t) b.tokens[size_t(t)] = (7 * t + 2) % c.vocab;
      b.domain[0] = dom;
      std::vector<float> loss(size_t(c.context));
      m.forward(b, loss.data());
      std::vector<float> full = m.logits();
      KVCacheDecoder dec(m, dom);
      for (int t = 0; t < c.context; ++t) {
        const float* l = dec.step(b.tokens[size_t(t)]);
        for (int v = 0; v < c.vocab; ++v)
          ASSERT_NEAR(l[v], full[size_t(t) * c.vocab + v], 1e-4) << router << " position " << t;
      }
    }
  }
}

TEST(Gate, TrainingLogsAuxLossAndDrops) {
  TempDir tmp("gate-cli");
  auto r = sigma_cmd("train --quiet --set model.router=top2 --set model.capacity_factor=0.8 "
                     "--set model.d_model=16 --set model.heads=2 --set model.context=8 "
                     "--set train.batch=6 --set train.log_every=2 --set train.eval_rows=6 "
                     "--set train.steps=4 --out " + tmp / "o");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("dropped over capacity"), std::string::npos) << r.out;
  std::ifstream metrics(tmp / "o/metrics.jsonl");
  std::string line;
  int records = 0;
  while (std::getline(metrics, line)) {
    auto j = nlohmann::json::parse(line);
    ++records;
    EXPECT_GT(j["aux_loss"].get<double>(), 0.0) << line;
    // Two RRE blocks; per block kept + dropped = 2 choices x 2 steps x 6 rows x 8 tokens.
    for (const auto& [block, groups] : j["expert_load"].items()) {
      int64_t kept = 0;
      for (const auto& [g, experts] : groups.items())
        for (const auto& n : experts) kept += n.get<int64_t>();
      EXPECT_EQ(kept + j["dropped"][block].get<int64_t>(), 2 * 2 * 6 * 8) << line;
      EXPECT_GT(j["dropped"][block].get<int64_t>(), 0) << line;
    }
  }
  EXPECT_EQ(records, 2);
  // summary.json: the whole run's drops, per block, with the same accounting over 4 steps.
  std::ifstream summary_file(tmp / "o/summary.json");
  const auto summary = nlohmann::json::parse(summary_file);
  ASSERT_TRUE(summary.contains("dropped")) << summary.dump();
  for (const auto& [block, groups] : summary["expert_load"].items()) {
    int64_t kept = 0;
    for (const auto& [g, experts] : groups.items())
      for (const auto& n : experts) kept += n.get<int64_t>();
    EXPECT_EQ(kept + summary["dropped"][block].get<int64_t>(), 2 * 4 * 6 * 8) << summary.dump();
  }
  r = sigma_cmd("inspect --json --ckpt " + tmp / "o/checkpoints");
  ASSERT_EQ(r.code, 0) << r.out;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["router"], "top2");
  EXPECT_TRUE(j["tables"].empty());  // a gated model has no routing tables
  // Active per token: two experts per expert block.
  const int64_t d = 16, f = 64;
  EXPECT_GT(j["parameters"]["active_per_token"].get<int64_t>(),
            j["parameters"]["shared"].get<int64_t>() + 2 * 2 * (2 * d * f) - 1);
}
