// Whole-model checks: the loss gradient against finite differences for a sample of every
// parameter tensor, with two domains on two embedding slots.
#include <gtest/gtest.h>

#include "gradcheck.h"
#include "model/model.h"
#include "test_util.h"

using namespace sigma;
using namespace sigma::testing;

static Batch tiny_batch(const ModelConfig& c, int B, int T, uint64_t seed) {
  Batch b;
  b.resize(B, T);
  Rng r(seed, 1);
  for (auto& t : b.tokens) t = int32_t(r.below(c.vocab));
  for (auto& t : b.targets) t = int32_t(r.below(c.vocab));
  for (int i = 0; i < B; ++i) b.domain[i] = i % 2;
  b.mask[1] = 0.0f;  // a masked position contributes nothing
  return b;
}

TEST(Model, LossGradientMatchesFiniteDifferencesForEveryTensor) {
  ModelConfig c = tiny_config();
  Model m(c, 42);
  // Non-trivial LayerNorm parameters and biases so their gradients are exercised too.
  for (Param& p : m.params().all())
    if (p.value.shape().size() == 1)
      edit_floats(p.value, [](float* v, int64_t n) { for (int64_t i = 0; i < n; ++i) v[i] += 0.2f * rng_normal(7, 3, i); });
  Batch b = tiny_batch(c, 3, 5, 1);
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
  for (Param& p : m.params().all()) {
    const std::vector<float> an = host_floats(p.grad);
    std::vector<size_t> idx;
    const size_t n = p.value.numel(), stride = n > 40 ? n / 23 : 1;
    for (size_t i = 0; i < n; i += stride) idx.push_back(i);
    expect_grad_matches(p.name, p.value, an, total, 1e-2, 2e-3, 2e-2, idx);
  }
}

TEST(Model, RowsOfUnusedSlotsAndPositionsGetNoGradient) {
  ModelConfig c = tiny_config();
  Model m(c, 1);
  Batch b = tiny_batch(c, 2, 4, 2);
  b.domain = {0, 0};  // only slot 0 is used
  std::vector<float> loss(b.tokens.size()), scale(b.tokens.size(), 1.0f);
  m.params().zero_grad();
  m.forward(b, loss.data(), scale.data());
  m.backward(b);
  const std::vector<float> e = host_floats(m.params().at("embed.tokens").grad);
  for (size_t i = size_t(c.vocab * c.d_model); i < e.size(); ++i) ASSERT_EQ(e[i], 0.0f);
  const std::vector<float> p = host_floats(m.params().at("embed.positions").grad);
  for (size_t i = size_t(4 * c.d_model); i < p.size(); ++i) ASSERT_EQ(p[i], 0.0f);
}

TEST(Model, ForwardIsCausal) {
  ModelConfig c = tiny_config();
  Model m(c, 3);
  Batch b = tiny_batch(c, 1, 6, 3);
  std::vector<float> l1(6), l2(6);
  m.forward(b, l1.data());
  b.tokens[4] = (b.tokens[4] + 1) % c.vocab;  // changing input 4 must not move losses 0..3
  m.forward(b, l2.data());
  for (int t = 0; t < 4; ++t) EXPECT_EQ(l1[t], l2[t]) << t;
  EXPECT_NE(l1[4], l2[4]);
}

TEST(Model, BadBatchIsAClearError) {
  ModelConfig c = tiny_config();
  Model m(c, 3);
  Batch b = tiny_batch(c, 1, 6, 3);
  std::vector<float> l(6);
  b.tokens[2] = c.vocab;
  EXPECT_THROW(m.forward(b, l.data()), Error);
  b = tiny_batch(c, 1, 6, 3);
  b.domain[0] = 5;
  EXPECT_THROW(m.forward(b, l.data()), Error);
  Batch longer = tiny_batch(c, 1, 7, 3);
  std::vector<float> l7(7);
  EXPECT_THROW(m.forward(longer, l7.data()), Error);
}
