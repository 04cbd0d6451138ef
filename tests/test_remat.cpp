// train.remat (model/activations.h, Remat): recomputing activations in backward instead of
// keeping them gives the same bits: the same losses and every parameter gradient identical,
// for a dense model, RRE experts and a learned top-2 gate, across two forward/backward pairs
// (the second reusing the activations). Also: the expert load is counted once per forward.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "device_access.h"
#include "core/error.h"
#include "core/rng.h"
#include "model/model.h"
#include "test_util.h"

using namespace sigma;
using sigma::testing::append_floats;
using sigma::testing::same_bits;

namespace {

ModelConfig config(int rre_layers, const char* router) {
  ModelConfig c;
  c.vocab = 29;
  c.d_model = 16;
  c.heads = 2;
  c.context = 9;
  c.layers = 4;
  c.slots = 1;
  c.rre_layers = rre_layers;
  c.router = router;
  c.domains = {{"a", "g1", 0}, {"b", "g2", 0}};
  if (rre_layers > 0) c.groups = {{"g1", 3}, {"g2", 2}};
  return c;
}

struct Result {
  std::vector<float> loss, grads;
  std::vector<int64_t> load;
};

Result run(const ModelConfig& c, Remat remat) {
  Model m(c, 5);
  m.set_remat(remat);
  Batch b;
  b.resize(3, 9);
  Rng r(11, 1);
  for (auto& t : b.tokens) t = int32_t(r.below(c.vocab));
  for (auto& t : b.targets) t = int32_t(r.below(c.vocab));
  b.domain = {0, 1, 0};
  Activations acts;
  Result out;
  std::vector<float> w(b.tokens.size(), 1.0f / float(b.tokens.size())), loss(w.size());
  for (int pass = 0; pass < 2; ++pass) {
    m.forward(b, acts, loss.data(), w.data());
    m.backward(b, acts);
    out.loss.insert(out.loss.end(), loss.begin(), loss.end());
  }
  for (const Param& p : m.params().all())
    append_floats(out.grads, p.grad);
  for (const BlockLoad& bl : m.expert_load())
    for (const auto& g : bl.tokens) out.load.insert(out.load.end(), g.begin(), g.end());
  return out;
}

TEST(Remat, RecomputationGivesTheSameBits) {
  struct Variant {
    const char* name;
    int rre_layers;
    const char* router;
  };
  for (const Variant& v : {Variant{"dense", 0, "rre"}, Variant{"rre", 2, "rre"},
                           Variant{"top2 gate", 2, "top2"}}) {
    const ModelConfig c = config(v.rre_layers, v.router);
    const Result none = run(c, Remat::None);
    double mass = 0;
    for (float g : none.grads) mass += std::fabs(g);
    ASSERT_GT(mass, 0.0) << v.name;
    for (Remat r : {Remat::Attention, Remat::Blocks}) {
      const Result got = run(c, r);
      const char* rn = r == Remat::Attention ? "attention" : "blocks";
      EXPECT_TRUE(same_bits(got.loss, none.loss)) << v.name << " remat=" << rn << ": losses";
      EXPECT_TRUE(same_bits(got.grads, none.grads)) << v.name << " remat=" << rn << ": gradients";
      EXPECT_EQ(got.load, none.load) << v.name << " remat=" << rn << ": expert load counted twice?";
    }
  }
}

TEST(Remat, NamesParseAndUnknownNamesAreRejected) {
  EXPECT_EQ(remat_from_name("none"), Remat::None);
  EXPECT_EQ(remat_from_name("attention"), Remat::Attention);
  EXPECT_EQ(remat_from_name("blocks"), Remat::Blocks);
  EXPECT_THROW(remat_from_name("everything"), Error);
}

}  // namespace
