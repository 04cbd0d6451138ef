// train.freeze (issue 6): a new domain trained alone with the shared parameters frozen leaves
// every other domain bit-identical; the selectors resolve to the tensors they name.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstring>

#include "device_access.h"
#include "cli_util.h"
#include "test_util.h"
#include "core/error.h"
#include "model/weights.h"
#include "train/checkpoint.h"
#include "io/checkpoint_dir.h"
#include "train/freeze.h"
#include "io/safetensors.h"
#include "train/trainer.h"

namespace sigma {
namespace {

using testing::sigma_cmd;
using testing::edit_floats;
using testing::host_floats;
using testing::TempDir;
using testing::same_bits;

const char* kSmall =
    "--quiet --set model.d_model=32 --set model.heads=2 --set model.context=32 "
    "--set train.batch=6 --set train.eval_rows=8 ";

TensorMap model_file(const std::string& root) {
  return read_model_tensors(resolve_checkpoint(root));
}

// Held-out logits of one synthetic domain under a checkpoint's model.
std::vector<float> logits_of(const std::string& root, const std::string& domain) {
  CheckpointInfo info;
  auto model = load_checkpoint_model(root, &info);
  Config c = info.cfg;
  c.data.domains = {domain};
  auto data = make_data_source(c);
  std::vector<float> out, loss;
  data->eval_batches(4, c.model.context, 8, [&](const Batch& b) {
    Batch mb = b;
    for (auto& d : mb.domain) d = model->config().domain_index(domain);
    loss.resize(mb.tokens.size());
    model->forward(mb, loss.data());
    { const std::vector<float> l = model->logits(); out.insert(out.end(), l.begin(), l.end()); }
  });
  return out;
}

// A model of the three synthetic domains; arith removed and added back as a new domain with
// its own group and slot (its experts copied from markov's); then arith trained alone with
// everything else frozen.
void new_domain_trains_alone(const std::string& experts_mode) {
  TempDir dir("freeze");
  auto r = sigma_cmd(std::string("train ") + kSmall + "--set train.steps=30 --out " + dir / "base");
  ASSERT_EQ(r.code, 0) << r.out;
  r = sigma_cmd(fmt::format("domains remove --ckpt {} --name arith --out {}", dir / "base/checkpoints",
                            dir / "removed"));
  ASSERT_EQ(r.code, 0) << r.out;
  r = sigma_cmd(fmt::format("domains add --ckpt {} --name arith --init-from markov --out {}",
                            dir / "removed", dir / "added"));
  ASSERT_EQ(r.code, 0) << r.out;
  r = sigma_cmd(fmt::format("train --quiet --resume {} --set 'data.domains=[\"arith\"]' --freeze shared "
                            "--set train.steps=12 --set train.experts={} --out {}",
                            dir / "added", experts_mode, dir / "trained"));
  ASSERT_EQ(r.code, 0) << r.out;

  const TensorMap before = model_file(dir / "added"), after = model_file(dir / "trained/checkpoints");
  ASSERT_EQ(before.size(), after.size());
  const int64_t V = before.at("embed.tokens").dim(0) / 2;  // two slots: markov+copy, arith
  for (const auto& [name, t] : before) {
    const Tensor& u = after.at(name);
    if (name.find(".rre.arith.") != std::string::npos) {
      if (name.find(".w_") != std::string::npos) {
        EXPECT_FALSE(same_bits(t, u)) << name << " did not train";
      }
    } else if (name == "embed.tokens") {
      const size_t row = size_t(t.dim(1)) * 4;
      EXPECT_EQ(std::memcmp(t.bytes(), u.bytes(), size_t(V) * row), 0) << "slot 0 moved";
      EXPECT_NE(std::memcmp(t.bytes() + V * row, u.bytes() + V * row, size_t(V) * row), 0)
          << "arith's slot did not train";
    } else {
      EXPECT_TRUE(same_bits(t, u)) << name << " is frozen but changed";
    }
  }
  for (const char* d : {"markov", "copy"})
    EXPECT_EQ(logits_of(dir / "added", d), logits_of(dir / "trained/checkpoints", d)) << d;
  EXPECT_NE(logits_of(dir / "added", "arith"), logits_of(dir / "trained/checkpoints", "arith"));
}

TEST(Freeze, NewDomainTrainsAloneAndTheOthersStayBitIdenticalEcss) { new_domain_trains_alone("ecss"); }
TEST(Freeze, NewDomainTrainsAloneAndTheOthersStayBitIdenticalInModel) { new_domain_trains_alone("model"); }

// Without the freeze the same run moves the shared tensors (the test above can fail).
TEST(Freeze, WithoutFreezeSharedTensorsMove) {
  TempDir dir("freeze");
  auto r = sigma_cmd(std::string("train ") + kSmall + "--set train.steps=4 --out " + dir / "base");
  ASSERT_EQ(r.code, 0) << r.out;
  r = sigma_cmd(fmt::format("train --quiet --resume {} --set 'data.domains=[\"arith\"]' "
                            "--set train.steps=8 --out {}", dir / "base/checkpoints", dir / "more"));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_FALSE(same_bits(model_file(dir / "base/checkpoints").at("blocks.0.attn.qkv.w"),
                         model_file(dir / "more/checkpoints").at("blocks.0.attn.qkv.w")));
}

Config freeze_config() {
  Config c;
  c.model.vocab = 16;
  c.model.d_model = 8;
  c.model.heads = 2;
  c.model.context = 4;
  c.model.slots = 2;
  c.model.groups = {{"ga", 2}, {"gb", 3}};
  c.model.domains = {{"a", "ga", 0}, {"b", "gb", 1}, {"c", "gb", 1}};
  return c;
}

TEST(Freeze, SelectorsNameTheirTensors) {
  const Config c = freeze_config();
  Model in_model(c.model, 1), stored(c.model, 1, nullptr, /*external_experts=*/true);
  auto frozen_names = [](const Model& m, const FreezePlan& p) {
    std::vector<std::string> out;
    for (size_t i = 0; i < m.params().all().size(); ++i)
      if (!p.mask.frozen.empty() && p.mask.frozen[i]) out.push_back(m.params().all()[i].name);
    return out;
  };
  FreezePlan p = plan_freeze({"embeddings"}, c.model, in_model.params(), false, {"a"});
  EXPECT_EQ(frozen_names(in_model, p), (std::vector<std::string>{"embed.tokens", "embed.positions"}));

  p = plan_freeze({"experts"}, c.model, stored.params(), true, {"a"});
  EXPECT_EQ(p.frozen_experts, (std::vector<uint8_t>{1, 1, 1, 1}));  // 2 RRE blocks x 2 groups
  EXPECT_TRUE(frozen_names(stored, p).empty());
  p = plan_freeze({"experts"}, c.model, in_model.params(), false, {"a"});
  EXPECT_EQ(frozen_names(in_model, p).size(), 16u);  // 2 blocks x 2 groups x 4 tensors

  // shared, training a alone: a's group ga and slot 0 train; everything else is frozen.
  p = plan_freeze({"shared"}, c.model, stored.params(), true, {"a"});
  EXPECT_EQ(p.frozen_experts, (std::vector<uint8_t>{0, 1, 0, 1}));
  const auto names = frozen_names(stored, p);
  EXPECT_EQ(std::count(names.begin(), names.end(), "embed.tokens"), 0);
  EXPECT_EQ(std::count(names.begin(), names.end(), "blocks.0.attn.qkv.w"), 1);
  const size_t tok = 0;  // embed.tokens is registered first
  ASSERT_EQ(stored.params().all()[tok].name, "embed.tokens");
  EXPECT_EQ(p.mask.rows.at(tok), (std::vector<std::pair<int64_t, int64_t>>{{0, 16}}));

  // A prefix names tensors; in a store only whole experts.
  p = plan_freeze({"blocks.1.rre.gb."}, c.model, in_model.params(), false, {"a"});
  EXPECT_EQ(frozen_names(in_model, p).size(), 4u);
  p = plan_freeze({"blocks.1.rre.gb."}, c.model, stored.params(), true, {"a"});
  EXPECT_EQ(p.frozen_experts, (std::vector<uint8_t>{0, 1, 0, 0}));  // block 1 is the first RRE block
  EXPECT_THROW(plan_freeze({"blocks.1.rre.gb.w_in"}, c.model, stored.params(), true, {"a"}), Error);
  try {
    plan_freeze({"nothing.like.this"}, c.model, in_model.params(), false, {"a"});
    FAIL() << "an unknown selector was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("nothing.like.this"), std::string::npos) << e.what();
  }
  // 'experts' on a dense model says the model has none (not "is not shared, embeddings or experts").
  Config dense = c;
  dense.model.rre_layers = 0;
  Model dense_model(dense.model, 1);
  try {
    plan_freeze({"experts"}, dense.model, dense_model.params(), false, {"a"});
    FAIL() << "freezing the experts of a dense model was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("the model is dense"), std::string::npos) << e.what();
  }
  // Training b alone would move c (same group and slot): refused, naming c.
  try {
    plan_freeze({"shared"}, c.model, stored.params(), true, {"b"});
    FAIL() << "a frozen domain sharing the trained one's slot was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'c'"), std::string::npos) << e.what();
  }
}

// The masked gradient is what the update and the norm see: frozen rows get exactly zero.
TEST(Freeze, MaskZeroesFrozenGradientsAndRows) {
  ParamSet ps;
  ps.add("a", {4, 3}, false);
  ps.add("b", {5}, false);
  Param &a = ps.at("a"), &b = ps.at("b");  // after both adds: add() may move earlier params
  edit_floats(a.grad, [](float* g, int64_t n) { for (int64_t i = 0; i < n; ++i) g[i] = float(i + 1); });
  edit_floats(b.grad, [](float* g, int64_t n) { std::fill(g, g + n, 1.0f); });
  UpdateMask m;
  m.frozen = {0, 1};
  m.rows = {{{1, 2}, {3, 4}}, {}};
  m.mask_grads(ps);
  const float expect[12] = {0, 0, 0, 4, 5, 6, 0, 0, 0, 10, 11, 12};
  const std::vector<float> ag = host_floats(a.grad), bg = host_floats(b.grad);
  for (int i = 0; i < 12; ++i) EXPECT_EQ(ag[size_t(i)], expect[i]) << i;
  for (int i = 0; i < 5; ++i) EXPECT_EQ(bg[size_t(i)], 0.0f);
  OptimConfig oc;
  AdamW opt(oc, ps);
  edit_floats(a.value, [](float* v, int64_t n) { std::fill(v, v + n, 1.0f); });
  edit_floats(b.value, [](float* v, int64_t n) { std::fill(v, v + n, 1.0f); });
  opt.step(ps, 0.1f, 1.0f, &m);
  const std::vector<float> av = host_floats(a.value), bv = host_floats(b.value);
  EXPECT_EQ(av[0], 1.0f);
  EXPECT_NE(av[3], 1.0f);
  EXPECT_EQ(av[6], 1.0f);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(bv[size_t(i)], 1.0f);
  EXPECT_EQ(opt.state()[1].step, 0);
}

// optim.sparse_embeddings: only the rows of the batch's tokens move, each row's Adam step
// counts the steps it appeared in, and a resumed run equals an uninterrupted one.
TEST(SparseEmbeddings, OnlyTheBatchRowsMoveWithTheirOwnStepCounts) {
  TempDir dir("sparse");
  const std::string common = std::string(kSmall) + "--set optim.sparse_embeddings=true --set train.steps=10 ";
  auto r = sigma_cmd("train " + common + "--out " + dir / "straight");
  ASSERT_EQ(r.code, 0) << r.out;
  r = sigma_cmd("train " + common + "--stop-at 4 --out " + dir / "parts");
  ASSERT_EQ(r.code, 0) << r.out;
  r = sigma_cmd(fmt::format("train --quiet --resume {} --out {}", dir / "parts/checkpoints", dir / "parts"));
  ASSERT_EQ(r.code, 0) << r.out;
  const TensorMap a = model_file(dir / "straight/checkpoints"), b = model_file(dir / "parts/checkpoints");
  for (const auto& [name, t] : a) EXPECT_TRUE(same_bits(t, b.at(name))) << name << " differs after resume";

  // Expected per-row counts from the same batches the trainer saw.
  CheckpointInfo info = open_checkpoint(dir / "straight/checkpoints");
  const Config& c = info.cfg;
  auto data = make_data_source(c);
  const int64_t rows = int64_t(c.model.slots) * c.model.vocab;
  std::vector<int64_t> expect(size_t(rows), 0);
  Batch batch;
  for (int64_t step = 0; step < c.train.steps; ++step) {
    data->train_batch(batch, c.train.batch, c.model.context, uint64_t(step));
    std::vector<uint8_t> seen(size_t(rows), 0);
    for (int row = 0; row < batch.B; ++row) {
      const int64_t base = int64_t(c.model.domains[size_t(batch.domain[size_t(row)])].slot) * c.model.vocab;
      for (int t = 0; t < batch.T; ++t) {
        seen[size_t(base + batch.tokens[size_t(row) * batch.T + t])] = 1;
        seen[size_t(base + batch.targets[size_t(row) * batch.T + t])] = 1;
      }
    }
    for (int64_t i = 0; i < rows; ++i) expect[size_t(i)] += seen[size_t(i)];
  }
  const TensorMap opt = read_optimizer_tensors(resolve_checkpoint(dir / "straight/checkpoints"));
  const Tensor& row_steps = opt.at("embed.tokens.row_steps");
  ASSERT_EQ(row_steps.numel(), rows);
  Model init(c.model, c.train.seed);
  const Tensor before = ops::to_host(init.params().at("embed.tokens").value);
  const Tensor& after = a.at("embed.tokens");
  const int64_t d = c.model.d_model;
  int unused = 0;
  for (int64_t i = 0; i < rows; ++i) {
    EXPECT_EQ(row_steps.data<int64_t>()[i], expect[size_t(i)]) << "row " << i;
    const bool same = std::memcmp(before.f() + i * d, after.f() + i * d, size_t(d) * 4) == 0;
    EXPECT_EQ(same, expect[size_t(i)] == 0) << "row " << i;
    unused += expect[size_t(i)] == 0;
  }
  EXPECT_GT(unused, 0) << "every row was used: the test cannot tell sparse from dense";
}

// Lazy per-row bias correction: a row first used at the second step gets Adam's first-update
// size, lr per element (m̂/sqrt(v̂) = ±1), not the damped one the tensor's step 2 would give
// (0.74 lr with beta 0.9 / 0.95).
TEST(SparseEmbeddings, ARowsFirstUpdateHasFullSize) {
  TempDir dir("sparse");
  auto r = sigma_cmd("train --quiet --set model.d_model=32 --set model.heads=2 "
                     "--set model.context=32 --set train.batch=1 --set train.eval_rows=8 "
                     "--set optim.sparse_embeddings=true --set train.steps=3 --set train.ckpt_every=1 "
                     "--set optim.weight_decay=0 --out " + dir / "run");
  ASSERT_EQ(r.code, 0) << r.out;
  CheckpointInfo info = open_checkpoint(dir / "run/checkpoints/step-00000002");
  const Config& c = info.cfg;
  auto data = make_data_source(c);
  const int64_t V = c.model.vocab, d = c.model.d_model;
  std::vector<std::vector<uint8_t>> used(2, std::vector<uint8_t>(size_t(c.model.slots * V), 0));
  Batch b;
  for (int step = 0; step < 2; ++step) {  // batch 1: one domain per step
    data->train_batch(b, 1, c.model.context, uint64_t(step));
    const int64_t base = int64_t(c.model.domains[size_t(b.domain[0])].slot) * V;
    for (int t = 0; t < b.T; ++t) {
      used[size_t(step)][size_t(base + b.tokens[size_t(t)])] = 1;
      used[size_t(step)][size_t(base + b.targets[size_t(t)])] = 1;
    }
  }
  const TensorMap m1 = model_file(dir / "run/checkpoints/step-00000001"),
                  m2 = model_file(dir / "run/checkpoints/step-00000002");
  const Tensor &w1 = m1.at("embed.tokens"), &w2 = m2.at("embed.tokens");
  const double lr = lr_at(c.optim, 1, c.train.steps);
  std::vector<double> ratios;
  for (int64_t row = 0; row < c.model.slots * V; ++row)
    if (used[1][size_t(row)] && !used[0][size_t(row)])
      for (int64_t j = 0; j < d; ++j)
        ratios.push_back(std::fabs(double(w2.f()[row * d + j]) - w1.f()[row * d + j]) / lr);
  ASSERT_FALSE(ratios.empty()) << "no row is first used at the second step";
  std::sort(ratios.begin(), ratios.end());
  EXPECT_NEAR(ratios[ratios.size() / 2], 1.0, 0.05);
}

}  // namespace
}  // namespace sigma
