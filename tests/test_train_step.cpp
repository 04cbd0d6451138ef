// The training step's seams (DESIGN §8): forward and backward as separate calls, the
// communicator the step reduces through, and the expert executor it drives.
#include <gtest/gtest.h>
#include <malloc.h>
#include <sys/mman.h>
#include <unistd.h>

#include <omp.h>

#include <algorithm>
#include <cstring>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "device_access.h"
#include "core/rng.h"
#include "dist/communicator.h"
#include "model/model.h"
#include "model/names.h"
#include "run/config.h"
#include "run/data_source.h"
#include "run/heldout.h"
#include "train/train_step.h"
#include "step_config.h"
#include "thread_comm.h"
#include "test_util.h"

using namespace sigma;
using sigma::testing::append_floats;
using sigma::testing::same_bits;
using sigma::testing::step_config;

namespace {

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

// Non-zero elements of t (param i's value or gradient) that rank 0 does not own.
int64_t others_nonzero(const ShardPlan& plan, size_t i, const Tensor& t) {
  const std::vector<float> v = sigma::testing::host_floats(t);
  const ParamPiece own = plan.owned(i, 0);
  int64_t n = 0;
  for (int64_t k = 0; k < int64_t(v.size()); ++k) n += (k < own.begin || k >= own.end) && v[size_t(k)] != 0.0f;
  return n;
}

// Trains `steps` steps of `micro` micro-batches on R thread-ranks (one OpenMP thread each)
// and returns rank 0's weights and per-step losses. Every rank's weights must agree.
struct RunResult {
  std::vector<float> weights;
  std::vector<double> losses, norms;
  int64_t reduced_bytes = 0;
  // Non-zero gradient elements of tensors rank 0 does not own, seen right after a backward.
  int64_t others_nonzero = 0;
  // Non-zero value elements of tensors rank 0 does not own, right after the first step, and
  // the weights settle() gives there (as a checkpoint between steps reads them).
  int64_t others_values_nonzero = 0;
  int cut = 0;  // tensors the plan cuts over the ranks
  std::vector<float> settled;
};

std::vector<float> flat(const Model& m) {
  std::vector<float> w;
  for (const Param& p : m.params().all()) append_floats(w, p.value);
  return w;
}

// overlap: 0 blocking exchanges, 1 dist.overlap, 2 dist.overlap with the gather deferred to
// the next forward. watch: rank 0 counts the other ranks' gradients after each backward (a
// fault-injection hook, after which an overlapped step starts its reductions; set on every
// rank).
// slab: the norm's slab, which the plan's cuts follow; vocab (when set) a larger vocabulary,
// whose embedding table ZeRO cuts over the ranks (with a small slab).
RunResult run_steps(int R, int rre_layers, int steps, int micro, bool sparse_rows = false,
                    int zero = 1, int overlap = 0, bool watch = true,
                    Remat remat = Remat::None, int64_t slab = kNormSlabElements, int vocab = 0) {
  RunResult out;
  std::vector<std::vector<float>> per_rank(static_cast<size_t>(R));
  test_ranks::run_ranks(R, [&](Communicator& comm) {
    omp_set_num_threads(1);
    ModelConfig c = step_config(rre_layers);
    if (vocab) c.vocab = vocab;
    // ZeRO-3 builds each rank's own values only (sharded construction), as `sigma train` does.
    Model::InitOnly init_only;
    if (zero == 3 && R > 1)
      init_only = [&](const ParamSet& ps) { return plan_shards(ps, R, slab).owned_by(comm.rank()); };
    Model m(c, 5, nullptr, false, {}, init_only);
    m.set_remat(remat);
    OptimConfig oc;
    oc.lr = 1e-2f;
    oc.grad_clip = 0.05f;  // clipping on: the norm must agree across ranks too
    const ShardPlan plan = plan_shards(m.params(), R, slab);
    if (comm.rank() == 0)
      for (size_t i = 0; i < m.params().all().size(); ++i) out.cut += !plan.whole(i);
    AdamW opt(oc, m.params(), R > 1 ? plan.owned_by(comm.rank()) : std::vector<ParamPiece>{});
    TrainStep step(m, opt, comm, oc, plan);
    step.set_zero_stage(zero);
    step.set_overlap(overlap > 0, overlap == 2);
    if (R > 1 && watch)  // on every rank (dist.zero = 3's gathers are ordered with the reductions)
      step.set_after_backward([&](ParamSet& ps) {
        if (comm.rank() != 0) return;
        for (size_t i = 0; i < ps.all().size(); ++i)
          out.others_nonzero += others_nonzero(plan, i, ps.all()[i].grad);
      });
    for (int s = 0; s < steps; ++s) {
      const auto batches = micro_batches(c, micro, uint64_t(s) + 1);
      UpdateMask mask;
      if (sparse_rows) {  // only embedding rows 0..5 and the last 3 train, lazily
        const int64_t rows = m.params().all()[0].value.dim(0);
        mask.rows.assign(m.params().all().size(), {});
        mask.lazy_rows.assign(m.params().all().size(), 0);
        mask.rows[0] = {{0, 5}, {rows - 3, rows}};
        mask.lazy_rows[0] = 1;
      }
      step.prepare(batches);
      const StepResult r = step.run(batches, oc.lr, mask);
      if (comm.rank() == 0) {
        double l = 0;
        for (double x : r.domain_loss) l += x;
        out.losses.push_back(l);
        out.norms.push_back(r.grad_norm);
      }
      if (s == 0) {  // between steps: what rank 0 holds, then every value (a checkpoint's read)
        if (comm.rank() == 0)
          for (size_t i = 0; i < m.params().all().size(); ++i)
            out.others_values_nonzero += others_nonzero(plan, i, m.params().all()[i].value);
        step.settle();
        if (comm.rank() == 0) out.settled = flat(m);
      }
    }
    step.settle();
    per_rank[size_t(comm.rank())] = flat(m);
    if (comm.rank() == 0) out.reduced_bytes = comm.stats().bytes();
  });
  for (int r = 1; r < R; ++r) EXPECT_EQ(per_rank[size_t(r)], per_rank[0]) << "rank " << r;
  out.weights = per_rank[0];
  return out;
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

// The reduction order that makes rank counts interchangeable: a tree over 8 parts is the tree
// over 2 (or 4) aligned blocks' subtotals, bit for bit, while a left fold is not.
TEST(TreeSum, BlocksOfAPowerOfTwoCombineToTheWholeTree) {
  const float v[8] = {1e8f, 1.0f, -1e8f, 3.0f, 0.1f, 7e7f, -7e7f, 0.3f};
  std::vector<const float*> parts;
  for (const float& x : v) parts.push_back(&x);
  float whole = 0;
  tree_sum(&whole, parts.data(), 8, 1);
  for (int blocks : {2, 4}) {
    std::vector<float> sub(static_cast<size_t>(blocks));
    for (int b = 0; b < blocks; ++b) tree_sum(&sub[size_t(b)], parts.data() + b * (8 / blocks), 8 / blocks, 1);
    std::vector<const float*> sp;
    for (const float& x : sub) sp.push_back(&x);
    float combined = 0;
    tree_sum(&combined, sp.data(), blocks, 1);
    EXPECT_EQ(combined, whole) << blocks << " blocks";
  }
  float left = 0;
  for (float x : v) left += x;
  EXPECT_NE(left, whole);  // the order matters for these values, so the test can fail
  // Three parts: (p0 + p1) + p2.
  const float a = 1e8f, b = -1e8f, c = 1.0f;
  const float* three[3] = {&a, &b, &c};
  float t = 0;
  tree_sum(&t, three, 3, 1);
  EXPECT_EQ(t, (a + b) + c);
}

// Every element has exactly one owner, the ranks' element counts add up to the model's.
void expect_a_partition(const ShardPlan& p, const ParamSet& ps, int R) {
  ASSERT_EQ(p.cuts.size(), ps.all().size());
  std::vector<int64_t> owned(size_t(R), 0);
  for (size_t i = 0; i < ps.all().size(); ++i) {
    const std::vector<int64_t>& c = p.cuts[i];
    ASSERT_EQ(c.size(), size_t(R) + 1);
    EXPECT_EQ(c.front(), 0);
    EXPECT_EQ(c.back(), ps.all()[i].value.numel());
    for (int r = 0; r < R; ++r) {
      EXPECT_LE(c[size_t(r)], c[size_t(r) + 1]) << ps.all()[i].name;
      owned[size_t(r)] += p.owned(i, r).size();
    }
  }
  EXPECT_EQ(owned, p.elements);
}

TEST(ShardPlan, BalancesWholeTensorsDeterministically) {
  const ModelConfig c = step_config(2);
  Model m(c, 5);
  const ShardPlan p = plan_shards(m.params(), 3);
  expect_a_partition(p, m.params(), 3);
  int64_t total = 0;
  for (int64_t e : p.elements) total += e;
  EXPECT_EQ(total, m.params().numel());
  // Greedy largest-first: no rank holds more than the least loaded plus the largest tensor.
  int64_t largest = 0;
  for (const Param& q : m.params().all()) largest = std::max(largest, q.value.numel());
  const auto [lo, hi] = std::minmax_element(p.elements.begin(), p.elements.end());
  EXPECT_LE(*hi - *lo, largest);
  EXPECT_EQ(plan_shards(m.params(), 3).cuts, p.cuts);
  for (size_t i = 0; i < m.params().all().size(); ++i)  // whole: the slab is larger than all
    EXPECT_TRUE(p.whole(i)) << m.params().all()[i].name;
}

// A tensor larger than half a rank's share (a big vocabulary's embedding table) is cut into
// row runs on slab boundaries so that the ranks' loads even out; a plan of whole tensors
// leaves one rank with most of the model.
TEST(ShardPlan, CutsATensorLargerThanHalfARanksShareIntoRowRuns) {
  ModelConfig c = step_config(0);
  c.vocab = 1000;  // embed.tokens [2000, 16]: 32 k of ~42 k elements
  Model m(c, 5);
  const ParamSet& ps = m.params();
  const int64_t slab = 256, width = c.d_model;
  for (int R : {2, 3, 4, 8}) {
    const ShardPlan p = plan_shards(ps, R, slab);
    expect_a_partition(p, ps, R);
    const double mean = double(ps.numel()) / R;
    const int64_t most = *std::max_element(p.elements.begin(), p.elements.end());
    EXPECT_LE(double(most), 1.2 * mean) << R << " ranks: " << fmt::format("{}", p.elements);
    EXPECT_FALSE(p.whole(0)) << ps.all()[0].name;
    for (int r = 0; r <= R; ++r) {
      const int64_t at = p.cuts[0][size_t(r)];
      EXPECT_TRUE(at % (slab_rows(ps.all()[0], slab) * width) == 0 || at == ps.all()[0].value.numel())
          << "cut at element " << at << " is not on a slab boundary";
    }
    // Whole tensors, as before: the table alone exceeds 1.2x the mean.
    const ShardPlan whole = plan_shards(ps, R, slab, [](size_t) { return false; });
    EXPECT_GT(double(*std::max_element(whole.elements.begin(), whole.elements.end())), 1.2 * mean);
  }
}

// Cut tensors train the bits of one rank: ZeRO-1, 2 and 3, blocking and overlapped, dense and
// RRE, lazy embedding rows on both sides of a cut; the norm's slabs are the same pieces
// whatever the rank count.
TEST(TrainStep, CutTensorsTrainTheBitsOfOneRank) {
  constexpr int64_t slab = 64;
  constexpr int vocab = 500;  // the embedding table is most of the model
  for (int rre : {0, 2}) {
    const RunResult one = run_steps(1, rre, 3, 4, false, 1, 0, false, Remat::None, slab, vocab);
    for (int R : {2, 4})
      for (int zero : {1, 2, 3})
        for (int overlap : {0, 1}) {
          const RunResult r = run_steps(R, rre, 3, 4, false, zero, overlap, false, Remat::None, slab, vocab);
          const std::string what = fmt::format("rre {} on {} ranks, zero {}, overlap {}", rre, R, zero, overlap);
          EXPECT_GT(r.cut, 0) << what << ": nothing cut";
          EXPECT_TRUE(same_bits(one.weights, r.weights)) << what;
          EXPECT_EQ(one.losses, r.losses) << what;
          EXPECT_EQ(one.norms, r.norms) << what;
          if (zero == 3) {
            EXPECT_EQ(r.others_values_nonzero, 0) << what << ": other ranks' rows kept";
          }
        }
  }
  const RunResult one = run_steps(1, 2, 3, 4, true, 1, 0, false, Remat::None, slab, vocab);
  for (int zero : {1, 3}) {
    const RunResult r = run_steps(4, 2, 3, 4, true, zero, 0, false, Remat::None, slab, vocab);
    EXPECT_TRUE(same_bits(one.weights, r.weights)) << "lazy embedding rows, zero " << zero;
  }
}

// Data parallel + ZeRO-1 at the same global batch: 1, 2 and 4 ranks give the same losses,
// norms and weights bit for bit (dense and RRE models, clipping on, lazy embedding rows).
TEST(TrainStep, OneTwoAndFourRanksAreBitIdentical) {
  for (int rre : {0, 2}) {
    const RunResult one = run_steps(1, rre, 4, 4), two = run_steps(2, rre, 4, 4), four = run_steps(4, rre, 4, 4);
    EXPECT_TRUE(same_bits(one.weights, two.weights)) << "rre " << rre;
    EXPECT_TRUE(same_bits(one.weights, four.weights)) << "rre " << rre;
    EXPECT_EQ(one.losses, two.losses);
    EXPECT_EQ(one.losses, four.losses);
    EXPECT_EQ(one.norms, four.norms);
    EXPECT_GT(two.reduced_bytes, 0);  // the gradients did travel
  }
  const RunResult one = run_steps(1, 2, 3, 4, true), two = run_steps(2, 2, 3, 4, true);
  EXPECT_TRUE(same_bits(one.weights, two.weights)) << "lazy embedding rows";
}

// dist.zero = 2 trains the bits of ZeRO-1: with one micro-batch per rank each stage of backward
// goes to its owners as it finishes and this rank's copies of the others' tensors are released
// (zero right after backward, where ZeRO-1 still holds them); with two per rank the tree sums
// first. Dense and RRE models, lazy embedding rows too.
TEST(TrainStep, ZeroStage2IsBitIdenticalToStage1) {
  struct Layout { int ranks, micro; };
  for (int rre : {0, 2})
    for (const Layout l : {Layout{2, 2}, Layout{4, 4}, Layout{2, 4}}) {
      const RunResult one = run_steps(l.ranks, rre, 3, l.micro),
                      two = run_steps(l.ranks, rre, 3, l.micro, false, 2);
      const std::string what = fmt::format("rre {} on {} ranks, {} micro-batches", rre, l.ranks, l.micro);
      EXPECT_TRUE(same_bits(one.weights, two.weights)) << what;
      EXPECT_EQ(one.losses, two.losses) << what;
      EXPECT_EQ(one.norms, two.norms) << what;
      EXPECT_GT(one.others_nonzero, 0) << what;  // ZeRO-1 holds every gradient: the check can fail
      if (l.micro == l.ranks) {
        EXPECT_EQ(two.others_nonzero, 0) << what << ": not released";
      }
    }
  const RunResult one = run_steps(2, 2, 3, 2, true), two = run_steps(2, 2, 3, 2, true, 2);
  EXPECT_TRUE(same_bits(one.weights, two.weights)) << "lazy embedding rows";
}

// dist.overlap: the reductions started per stage of backward (after folding the stage's tree
// of partial sums, with several micro-batches per rank) and the gather deferred to the next
// forward give the blocking exchanges' bits; with the fault-injection hook too.
TEST(TrainStep, OverlappedZeroIsBitIdenticalToBlocking) {
  struct Layout { int ranks, micro; };
  for (int rre : {0, 2})
    for (const Layout l : {Layout{2, 2}, Layout{4, 4}, Layout{2, 4}, Layout{2, 8}})
      for (int zero : {1, 2}) {
        const RunResult base = run_steps(l.ranks, rre, 3, l.micro, false, zero, 0, false);
        for (int overlap : {1, 2})
          for (bool watch : {false, true}) {
            const RunResult o = run_steps(l.ranks, rre, 3, l.micro, false, zero, overlap, watch);
            const std::string what = fmt::format("rre {} on {} ranks, {} micro-batches, zero {}, "
                                                 "overlap {}, hook {}", rre, l.ranks, l.micro,
                                                 zero, overlap, watch);
            EXPECT_TRUE(same_bits(base.weights, o.weights)) << what;
            EXPECT_EQ(base.losses, o.losses) << what;
            EXPECT_EQ(base.norms, o.norms) << what;
          }
      }
  const RunResult one = run_steps(2, 2, 3, 2, true), two = run_steps(2, 2, 3, 2, true, 2, 2);
  EXPECT_TRUE(same_bits(one.weights, two.weights)) << "lazy embedding rows";
}

// dist.zero = 3 trains the bits of ZeRO-1: each rank keeps only its own values between steps
// (the others' read as zeros there), gathers each stage from its owners before a pass reads it
// (ahead of use with dist.overlap), and settle() gives every value whole between steps (read
// after the first step, then training goes on). Dense and RRE models, one and two micro-batches
// per rank, lazy embedding rows too.
TEST(TrainStep, ZeroStage3IsBitIdenticalToStage1) {
  struct Layout { int ranks, micro; };
  for (int rre : {0, 2})
    for (const Layout l : {Layout{2, 2}, Layout{4, 4}, Layout{2, 4}}) {
      const RunResult one = run_steps(l.ranks, rre, 3, l.micro, false, 1, 0, false);
      EXPECT_GT(one.others_values_nonzero, 0);  // ZeRO-1 holds every value: the check can fail
      for (int overlap : {0, 1, 2}) {
        const RunResult three = run_steps(l.ranks, rre, 3, l.micro, false, 3, overlap, overlap != 2);
        const std::string what = fmt::format("rre {} on {} ranks, {} micro-batches, overlap {}", rre,
                                             l.ranks, l.micro, overlap);
        EXPECT_TRUE(same_bits(one.weights, three.weights)) << what;
        EXPECT_TRUE(same_bits(one.settled, three.settled)) << what << ": settled after step 1";
        EXPECT_EQ(one.losses, three.losses) << what;
        EXPECT_EQ(one.norms, three.norms) << what;
        EXPECT_EQ(three.others_values_nonzero, 0) << what << ": other ranks' values kept";
        if (l.micro == l.ranks && overlap == 0) {
          EXPECT_EQ(three.others_nonzero, 0) << what << ": gradients kept";
        }
      }
    }
  const RunResult one = run_steps(2, 2, 3, 2, true), three = run_steps(2, 2, 3, 2, true, 3, 1);
  EXPECT_TRUE(same_bits(one.weights, three.weights)) << "lazy embedding rows";
}

// train.remat under ZeRO-3 (the memory it saves adds to ZeRO-3's, docs/distributed.md): a
// recomputed block asks for its stage (and its expert groups) again in backward, and the
// weights are still ZeRO-1's without remat, bit for bit.
TEST(TrainStep, ZeroStage3WithRematIsBitIdenticalToStage1) {
  for (int rre : {0, 2})
    for (int ranks : {2, 4}) {
      const RunResult one = run_steps(ranks, rre, 3, ranks, false, 1, 0, false);
      for (Remat remat : {Remat::Attention, Remat::Blocks})
        for (int overlap : {0, 1, 2}) {
          const RunResult three =
              run_steps(ranks, rre, 3, ranks, false, 3, overlap, false, remat);
          const std::string what = fmt::format("rre {} on {} ranks, remat {}, overlap {}", rre,
                                               ranks, int(remat), overlap);
          EXPECT_TRUE(same_bits(one.weights, three.weights)) << what;
          EXPECT_EQ(one.losses, three.losses) << what;
          EXPECT_EQ(three.others_values_nonzero, 0) << what << ": other ranks' values kept";
        }
    }
}

TEST(TrainStep, RefusesARankCountThatCannotSplitTheBatch) {
  test_ranks::run_ranks(2, [&](Communicator& comm) {
    const ModelConfig c = step_config(0);
    Model m(c, 5);
    OptimConfig oc;
    const ShardPlan plan = plan_shards(m.params(), 2);
    AdamW opt(oc, m.params(), plan.owned_by(comm.rank()));
    TrainStep step(m, opt, comm, oc, plan);
    const auto batches = micro_batches(c, 3, 1);
    EXPECT_THROW(step.prepare(batches), Error);
    const auto six = micro_batches(c, 6, 1);  // 3 per rank: not a power of two
    EXPECT_THROW(step.prepare(six), Error);
  });
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
  TrainStep step(m, opt, comm, oc, plan_shards(m.params(), 1));
  const auto micro = micro_batches(c, 2, 9);
  step.prepare(micro);
  step.run(micro, 1e-3f, UpdateMask{});
  EXPECT_EQ(ex.begun, 2);
  EXPECT_EQ(ex.forwards, 2 * 2);  // two RRE blocks, two micro-batches
  EXPECT_EQ(ex.backwards, 2 * 2);
  EXPECT_EQ(ex.rows, 2 * 2 * 3 * c.context);
  EXPECT_EQ(ex.updates, 1);
  m.set_expert_executor(nullptr);
}

// A ZeRO-3 training step on one of 4 ranks (the members in construction order: TrainStep
// keeps references to the others).
struct Zero3Step {
  Model m;
  OptimConfig oc;
  ShardPlan plan;
  AdamW opt;
  TrainStep step;
  Zero3Step(Communicator& comm, const ModelConfig& c, bool overlap)
      : m(c, 5), plan(plan_shards(m.params(), 4)), opt(oc, m.params(), plan.owned_by(comm.rank())),
        step(m, opt, comm, oc, plan) {
    step.set_zero_stage(3);
    step.set_overlap(overlap);
  }
};

// dist.zero = 3 reads an RRE block's experts one by one (Model::expert_stages: each expert's
// slice of its group's stacked tensors): a rank holds at most one expert's worth of the other
// ranks' expert values at a time, not a group's (where the memory peak was), blocking and
// overlapped, with the same bits as ZeRO-1 (ZeroStage3IsBitIdenticalToStage1).
TEST(TrainStep, ZeroStage3GathersOneExpertAtATime) {
  for (int overlap : {0, 1}) {
    test_ranks::run_ranks(4, [&](Communicator& comm) {
      omp_set_num_threads(1);
      const ModelConfig c = step_config(2);
      Zero3Step z(comm, c, overlap > 0);
      const Model& m = z.m;
      const ShardPlan& plan = z.plan;
      // The bound: one expert's slices of its group's tensors that this rank does not own; a
      // group's would exceed it wherever the rank misses a tensor of a group of 2 or more.
      int64_t expert_max = 0, group_max = 0;
      for (int l = c.first_rre_block(); l < c.layers; ++l)
        for (const GroupSpec& g : c.groups) {
          int64_t n = 0;
          for (size_t i = 0; i < m.params().all().size(); ++i) {
            const Param& p = m.params().all()[i];
            if (p.name.starts_with(names::expert_prefix(l, g.name) + "."))
              n += p.value.numel() - plan.owned(i, comm.rank()).size();
          }
          expert_max = std::max(expert_max, n / g.experts);
          group_max = std::max(group_max, n);
        }
      for (int s = 0; s < 2; ++s) {
        const auto batches = micro_batches(c, 4, uint64_t(s) + 1);
        z.step.prepare(batches);
        z.step.run(batches, z.oc.lr, UpdateMask{});
      }
      const std::string what = fmt::format("rank {}, overlap {}, a group's {}", comm.rank(), overlap,
                                           group_max);
      EXPECT_GT(z.step.peak_gathered_expert_elements(), 0) << what;
      EXPECT_LE(z.step.peak_gathered_expert_elements(), expert_max) << what;
    });
  }
}

// Elements of the model's largest stage (Model::param_stages) and of all of them.
static std::pair<size_t, size_t> stage_sizes(const Model& m) {
  size_t largest = 0, all = 0;
  for (const ParamStage& pieces : m.param_stages()) {
    size_t n = 0;
    for (const ParamPiece& p : pieces) n += size_t(p.size());
    largest = std::max(largest, n);
    all += n;
  }
  return {largest, all};
}

// Thread ranks whose non-blocking exchanges complete only when waited for (as an MPI
// library's that is not progressed): what TrainStep keeps in flight is then its bound's doing.
class UnprogressedComm final : public Communicator {
 public:
  explicit UnprogressedComm(Communicator& c) : c_(c) { world_size_ = c.size(); }
  int rank() const override { return c_.rank(); }
  int size() const override { return c_.size(); }
  void barrier() override { c_.barrier(); }
  std::unique_ptr<Communicator> split(int) override { throw std::logic_error("not here"); }

 protected:
  struct Op final : PendingOp {
    std::unique_ptr<PendingOp> op;
    bool test() override { return false; }
    void wait() override { op->wait(); }
  };
  static std::unique_ptr<PendingOp> later(std::unique_ptr<PendingOp> op) {
    auto o = std::make_unique<Op>();
    o->op = std::move(op);
    return o;
  }
  void do_all_reduce_sum(float* x, size_t n) override { c_.all_reduce_sum(x, n); }
  void do_all_reduce_sum(double* x, size_t n) override { c_.all_reduce_sum(x, n); }
  void do_reduce_scatter_sum(float* o, const float* i, size_t n) override { c_.reduce_scatter_sum(o, i, n); }
  void do_reduce_scatter_sum_v(float* o, const float* i, const int64_t* n) override {
    c_.reduce_scatter_sum_v(o, i, n);
  }
  void do_all_gather(float* o, const float* i, size_t n) override { c_.all_gather(o, i, n); }
  void do_all_gather(double* o, const double* i, size_t n) override { c_.all_gather(o, i, n); }
  void do_all_gather_v(float* o, const float* i, const int64_t* n) override { c_.all_gather_v(o, i, n); }
  void do_all_to_all_v(const float* s, const int64_t* sc, float* r, const int64_t* rc) override {
    c_.all_to_all_v(s, sc, r, rc);
  }
  void do_broadcast(void* d, size_t b, int root) override { c_.broadcast(d, b, root); }
  std::unique_ptr<PendingOp> do_start_all_to_all_v(const float* s, const int64_t* sc, float* r,
                                                  const int64_t* rc) override {
    return later(c_.start_all_to_all_v(s, sc, r, rc));
  }
  std::unique_ptr<PendingOp> do_start_all_gather_v(float* o, const float* i, const int64_t* n) override {
    return later(c_.start_all_gather_v(o, i, n));
  }
  std::unique_ptr<PendingOp> do_start_reduce_scatter_sum_v(float* o, const float* i,
                                                          const int64_t* n) override {
    return later(c_.start_reduce_scatter_sum_v(o, i, n));
  }

 private:
  Communicator& c_;
};

// dist.zero = 3 with dist.overlap: the exchange buffers in flight (reductions started as
// backward finishes each stage, prefetched gathers) stay within about one round of the largest
// stage: 2x its elements, or one round alone where it is more (a reduce round counts its
// packed copy and R times this rank's part: (R + 1)x). ZeRO-1's bound of 8 buckets (32 M
// elements) leaves every stage of backward in flight at once here (fails on it); the bits are
// ZeroStage3IsBitIdenticalToStage1's. At d = 256 the largest stage (0.79 M elements) is larger
// than ZeRO-3's round (kZero3BucketElements), so the bound is two of those rounds (0.52 M
// elements in flight), not of ZeRO-1's 16x larger rounds (fails with them: 1.6-1.8 M).
TEST(TrainStep, ZeroStage3KeepsAboutOneStagesExchangeInFlight) {
  for (int d : {16, 256}) {
    test_ranks::run_ranks(4, [&](Communicator& threads) {
      UnprogressedComm comm(threads);
      omp_set_num_threads(1);
      ModelConfig c = step_config(2);
      c.d_model = d;
      Zero3Step z(comm, c, true);
      const auto [stage, all] = stage_sizes(z.m);
      for (int s = 0; s < 2; ++s) {
        const auto batches = micro_batches(c, 4, uint64_t(s) + 1);
        z.step.prepare(batches);
        z.step.run(batches, z.oc.lr, UpdateMask{});
      }
      const std::string what = fmt::format("rank {}, d = {}: the largest stage {} of {} elements",
                                           comm.rank(), d, stage, all);
      EXPECT_GT(z.step.overlap_peak_in_flight(), 0u) << what;
      // A stage of one round: its round and the next; of several: two rounds of a bucket.
      const size_t limit = stage <= kZero3BucketElements ? 5 * stage : 5 * kZero3BucketElements / 2;
      EXPECT_LE(z.step.overlap_peak_in_flight(), limit) << what;
    });
  }
}

// dist.overlap_mib: ZeRO-1 and 2's exchange buffers in flight stay within the bound a user
// gives (plus the one round that may exceed it alone: a reduce round counts its packed copy and
// R times this rank's part, ~2x a stage), with the bits of the default bound. On ranks that
// never progress an exchange the default (8 buckets: 32 M elements) keeps every stage of
// backward in flight, so a TrainStep that ignored the bound fails the first check.
TEST(TrainStep, ZeroOverlapKeepsTheBoundItIsGiven) {
  for (int zero : {1, 2}) {
    std::vector<float> weights[2];
    size_t peak[2] = {}, stage = 0;
    for (int bounded : {0, 1}) {
      test_ranks::run_ranks(4, [&](Communicator& threads) {
        UnprogressedComm comm(threads);
        omp_set_num_threads(1);
        ModelConfig c = step_config(2);
        c.d_model = 64;
        Model m(c, 5);
        OptimConfig oc;
        oc.lr = 1e-2f;
        const ShardPlan plan = plan_shards(m.params(), 4);
        AdamW opt(oc, m.params(), plan.owned_by(comm.rank()));
        TrainStep step(m, opt, comm, oc, plan);
        step.set_zero_stage(zero);
        const size_t largest = stage_sizes(m).first;
        step.set_overlap(true, false, bounded ? largest : 0);
        for (int s = 0; s < 2; ++s) {
          const auto batches = micro_batches(c, 4, uint64_t(s) + 1);
          step.prepare(batches);
          step.run(batches, oc.lr, UpdateMask{});
        }
        if (comm.rank() == 0) {
          stage = largest;
          peak[bounded] = step.overlap_peak_in_flight();
          weights[bounded] = flat(m);
        }
      });
    }
    const std::string what = fmt::format("zero {}: the largest stage {} elements, peak in flight "
                                         "{} with the default bound, {} bounded to one stage",
                                         zero, stage, peak[0], peak[1]);
    EXPECT_GT(peak[0], 3 * stage) << what;
    EXPECT_LE(peak[1], 3 * stage) << what;
    EXPECT_GT(peak[1], 0u) << what;
    EXPECT_TRUE(weights[0] == weights[1]) << what << ": the bound changed the bits";
  }
}

// Sharded construction (dist.zero = 3): a rank never writes the values, gradients or optimizer
// state of the tensors (or the rows of a cut tensor) it does not own, so their pages stay out
// of memory through construction and the step's setup (mincore). Fails where the model
// initialises every tensor, or a cut tensor whole, or the allocator writes its zeros.
TEST(TrainStep, ZeroStage3LeavesOtherRanksTensorsUntouchedAtStartUp) {
  // Residency is the host allocator's: the guard backend's memory is its own (and only ops may
  // touch it), so this runs on the cpu backend (its Cpu. twin in ctest).
  if (ops::device() != Device::Host)
    GTEST_SKIP() << "tensors are not in host memory on this backend: mincore says nothing";
  // Blocks of 256 KiB and more fresh from the system (as the model's tensors of a real size
  // are), whatever this process freed before; the default dynamic threshold restored after.
  ASSERT_EQ(mallopt(M_MMAP_THRESHOLD, 256 << 10), 1);
  const long page = sysconf(_SC_PAGESIZE);
  // Pages of bytes [b, e) of t resident, but for the two at the ends (zero_release writes
  // partial pages).
  auto resident = [page](const Tensor& t, size_t from, size_t to) {
    const uintptr_t b = (uintptr_t(t.bytes()) + from + page - 1) / page * page + page;
    const uintptr_t e = (uintptr_t(t.bytes()) + to) / page * page - page;
    if (e <= b) return int64_t(0);
    std::vector<unsigned char> v((e - b) / page);
    EXPECT_EQ(mincore(reinterpret_cast<void*>(b), e - b, v.data()), 0);
    return int64_t(std::count_if(v.begin(), v.end(), [](unsigned char x) { return x & 1; }));
  };
  ModelConfig c = step_config(2);
  c.d_model = 256;  // expert matrices of 1 MiB
  c.vocab = 8192;   // an embedding table (2 slots: 16 MiB) the plan cuts into row runs
  test_ranks::run_ranks(2, [&](Communicator& comm) {
    omp_set_num_threads(1);
    Model m(c, 5, nullptr, false, {},
            [&](const ParamSet& ps) { return plan_shards(ps, 2).owned_by(comm.rank()); });
    OptimConfig oc;
    const ShardPlan plan = plan_shards(m.params(), 2);
    AdamW opt(oc, m.params(), plan.owned_by(comm.rank()));
    TrainStep step(m, opt, comm, oc, plan);
    step.set_zero_stage(3);
    step.prepare(micro_batches(c, 2, 1));
    // Whole tensors and the runs of rows of a cut one (parallel/shard_plan.h) that another
    // rank owns must stay out of memory; the rank's own must have been written.
    int64_t big_others = 0, big_own_resident = 0, cut = 0;
    for (size_t i = 0; i < m.params().all().size(); ++i) {
      const Param& p = m.params().all()[i];
      if (p.value.nbytes() < (512 << 10)) continue;
      const ParamPiece own = plan.owned(i, comm.rank());
      cut += !plan.whole(i);
      const size_t b = size_t(own.begin) * 4, e = size_t(own.end) * 4, n = p.value.nbytes();
      if (e > b) big_own_resident += resident(p.value, b, e) > 0;  // can fail: own values written
      for (auto [from, to] : {std::pair{size_t(0), e > b ? b : n}, std::pair{e > b ? e : n, n}}) {
        if (to - from < (256 << 10)) continue;
        ++big_others;
        EXPECT_EQ(resident(p.value, from, to), 0) << p.name << " [" << from << ", " << to
                                                  << ") on rank " << comm.rank();
        EXPECT_EQ(resident(p.grad, from, to), 0) << p.name << "'s gradient on rank " << comm.rank();
      }
    }
    EXPECT_GT(big_others, 0);
    EXPECT_GT(big_own_resident, 0);
    EXPECT_GT(cut, 0);  // the rows of a cut tensor: written by their owner only
  });
  mallopt(M_MMAP_THRESHOLD, 128 << 10);
}

// A training run's held-out evaluation shared by its data ranks (run/heldout.h's EvalRanks):
// each rank runs about 1/R of the batches (its model's expert load counts the rows it ran;
// every rank ran every batch before), and the per-domain losses are one process's bits, on 2
// and 4 ranks, with a last round of fewer batches than ranks (7 batches).
TEST(HeldOut, DataRanksShareTheBatchesAndKeepOneProcesssBits) {
  Config c;
  c.train.batch = 4;
  c.model.d_model = 16, c.model.heads = 2, c.model.layers = 2, c.model.context = 8;
  const auto data = make_data_source(c);
  c.model.vocab = data->vocab();
  c.model.domains = data->domain_specs();
  c.model.rre_layers = 1;
  c.model.groups.clear();
  for (const std::string& d : data->domains()) c.model.groups.push_back({d, 2});
  const int rows = 9, T = c.model.context;  // 9 rows of each of 3 domains: 7 batches of 4
  auto routed = [](const Model& m) {
    int64_t n = 0;
    for (const BlockLoad& b : m.expert_load())
      for (const auto& g : b.tokens)
        for (int64_t t : g) n += t;
    return n;
  };
  Model one(c.model, 3);
  const std::vector<DomainLoss> whole = evaluate(one, *data, c.train.batch, T, rows);
  ASSERT_EQ(routed(one), int64_t(3 * rows * T));
  for (int R : {2, 4}) {
    test_ranks::run_ranks(R, [&](Communicator& comm) {
      omp_set_num_threads(1);
      Model m(c.model, 3);
      const EvalRanks ranks{comm.rank(), comm.size(), [&](float* all, const float* mine, size_t n) {
                              comm.all_gather(all, mine, n);
                            }};
      const std::vector<DomainLoss> shared = evaluate(m, *data, c.train.batch, T, rows, {}, {},
                                                      nullptr, &ranks);
      const int rounds = (7 + R - 1) / R;
      EXPECT_LE(routed(m), int64_t(rounds * c.train.batch * T)) << R << " ranks, rank " << comm.rank();
      ASSERT_EQ(shared.size(), whole.size());
      for (size_t d = 0; d < whole.size(); ++d) {
        EXPECT_EQ(shared[d].tokens, whole[d].tokens) << whole[d].name;
        EXPECT_EQ(std::memcmp(&shared[d].nats, &whole[d].nats, sizeof(double)), 0) << R << " ranks, " << whole[d].name;
      }
    });
  }
}
