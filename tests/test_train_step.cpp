// The training step's seams (DESIGN §8): forward and backward as separate calls, the
// communicator the step reduces through, and the expert executor it drives.
#include <gtest/gtest.h>

#include <cstring>

#include "core/rng.h"
#include "dist/communicator.h"
#include "model/model.h"
#include "train/train_step.h"

using namespace sigma;

namespace {

ModelConfig step_config(int rre_layers) {
  ModelConfig c;
  c.vocab = 17;
  c.d_model = 16;
  c.heads = 2;
  c.context = 8;
  c.layers = 3;
  c.slots = 2;
  c.domains = {{"a", "a", 0}, {"b", "b", 1}};
  c.rre_layers = rre_layers;
  if (rre_layers) c.groups = {{"a", 3}, {"b", 2}};
  return c;
}

std::vector<Batch> micro_batches(const ModelConfig& c, int n, uint64_t seed) {
  std::vector<Batch> out(static_cast<size_t>(n));
  Rng r(seed, 1);
  for (Batch& b : out) {
    b.resize(3, c.context);
    for (auto& t : b.tokens) t = int32_t(r.below(uint64_t(c.vocab)));
    for (auto& t : b.targets) t = int32_t(r.below(uint64_t(c.vocab)));
    for (int i = 0; i < b.B; ++i) b.domain[size_t(i)] = int32_t(r.below(2));
    b.mask[2] = 0.0f;
  }
  return out;
}

// Two identical data-parallel replicas, simulated in one process: every sum over ranks is
// twice this rank's value. Each replica holds half the global batch's mask total, so a step
// that reduces the mask total and every gradient computes exactly the one-rank step (scaling
// by two is exact in binary floating point).
class TwoReplicas final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 2; }
  void all_reduce_sum(float* x, int64_t n) override {
    for (int64_t i = 0; i < n; ++i) x[i] += x[i];
    reduced_floats += n;
  }
  void all_reduce_sum(double* x, int64_t n) override {
    for (int64_t i = 0; i < n; ++i) x[i] += x[i];
  }
  void reduce_scatter_sum(float*, const float*, int64_t) override { FAIL(); }
  void all_gather(float*, const float*, int64_t) override { FAIL(); }
  void all_to_all_v(const float*, const int64_t*, float*, const int64_t*) override { FAIL(); }
  void broadcast(void*, size_t, int) override { FAIL(); }
  void barrier() override {}
  int64_t reduced_floats = 0;
};

std::vector<float> run_steps(Communicator& comm, int rre_layers, int steps) {
  const ModelConfig c = step_config(rre_layers);
  Model m(c, 5);
  OptimConfig oc;
  oc.lr = 1e-2f;
  AdamW opt(oc, m.params());
  TrainStep step(m, opt, comm, oc);
  for (int s = 0; s < steps; ++s) {
    const auto micro = micro_batches(c, 2, uint64_t(s) + 1);
    step.prepare(micro);
    step.run(micro, oc.lr, UpdateMask{}, nullptr);
  }
  std::vector<float> w;
  for (const Param& p : m.params().all()) w.insert(w.end(), p.value.f(), p.value.f() + p.value.numel());
  return w;
}

}  // namespace

TEST(Communicator, SingleProcessCollectivesAreIdentities) {
  SingleProcess c;
  EXPECT_EQ(c.rank(), 0);
  EXPECT_EQ(c.size(), 1);
  std::vector<float> in{1, 2, 3}, out(3, 0.0f);
  c.all_gather(out.data(), in.data(), 3);
  EXPECT_EQ(out, in);
  out.assign(3, 0.0f);
  c.reduce_scatter_sum(out.data(), in.data(), 3);
  EXPECT_EQ(out, in);
  out.assign(3, 0.0f);
  const int64_t n = 3;
  c.all_to_all_v(in.data(), &n, out.data(), &n);
  EXPECT_EQ(out, in);
  const int64_t wrong = 2;
  EXPECT_THROW(c.all_to_all_v(in.data(), &n, out.data(), &wrong), Error);
  EXPECT_THROW(c.broadcast(out.data(), 4, 1), Error);
}

TEST(TrainStep, ReducesEveryGradientAndTheMaskTotalThroughTheCommunicator) {
  for (int rre : {0, 2}) {
    SingleProcess one;
    TwoReplicas two;
    const auto a = run_steps(one, rre, 3), b = run_steps(two, rre, 3);
    ASSERT_EQ(a.size(), b.size());
    EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0) << "rre_layers " << rre;
    // Every parameter's gradient went through the communicator at every step.
    EXPECT_EQ(two.reduced_floats, 3 * int64_t(a.size())) << "rre_layers " << rre;
  }
}

TEST(TrainStep, BackwardNeedsAForwardWithLossWeights) {
  const ModelConfig c = step_config(0);
  Model m(c, 5);
  const auto micro = micro_batches(c, 1, 1);
  std::vector<float> loss(micro[0].tokens.size());
  m.forward(micro[0], loss.data());  // evaluation: no loss weights, no gradient of the logits
  EXPECT_THROW(m.backward(micro[0]), Error);
  m.forward(micro[0], loss.data(), micro[0].mask.data());
  m.backward(micro[0]);
  EXPECT_THROW(m.backward(micro[0]), Error);  // the head's gradient was consumed
}

// An executor that counts the seam's calls and delegates to the local experts.
class CountingExperts final : public LocalExperts {
 public:
  void forward(int block, const RreWeights& w, const RrePlan& p, const ExpertBuffers& b, float* y,
               const float* x, int64_t N, int64_t d, int64_t f) override {
    ++forwards;
    rows += N;
    LocalExperts::forward(block, w, p, b, y, x, N, d, f);
  }
  void backward(int block, const RreWeights& w, const RrePlan& p, const ExpertBuffers& b,
                float* dx, const float* dy, const float* x, int64_t N, int64_t d,
                int64_t f) override {
    ++backwards;
    LocalExperts::backward(block, w, p, b, dx, dy, x, N, d, f);
  }
  void begin_step(std::span<const Batch> micro) override { begun += int(micro.size()); }
  void update(float, float) override { ++updates; }
  int forwards = 0, backwards = 0, begun = 0, updates = 0;
  int64_t rows = 0;
};

TEST(TrainStep, RreBlocksRunTheirExpertsThroughTheExecutor) {
  const ModelConfig c = step_config(2);
  Model m(c, 5);
  CountingExperts ex;
  m.set_expert_executor(&ex);
  OptimConfig oc;
  AdamW opt(oc, m.params());
  SingleProcess comm;
  TrainStep step(m, opt, comm, oc);
  const auto micro = micro_batches(c, 2, 9);
  step.prepare(micro);
  step.run(micro, 1e-3f, UpdateMask{}, nullptr);
  EXPECT_EQ(ex.begun, 2);
  EXPECT_EQ(ex.forwards, 2 * 2);  // two RRE blocks, two micro-batches
  EXPECT_EQ(ex.backwards, 2 * 2);
  EXPECT_EQ(ex.rows, 2 * 2 * 3 * c.context);
  EXPECT_EQ(ex.updates, 1);
  m.set_expert_executor(nullptr);
}
