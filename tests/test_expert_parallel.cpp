// Expert parallelism inside each expert group (issue 11, parallel/expert_parallel.h), on thread
// ranks: the experts of a group spread over its ranks, rows exchanged inside the group only,
// and the same bits as one process at the same global batch.
#include <gtest/gtest.h>

#include <omp.h>

#include <cstring>
#include <map>
#include <tuple>

#include "device_access.h"
#include "core/rng.h"
#include "ecss/ecss_experts.h"
#include "parallel/expert_parallel.h"
#include "model/model.h"
#include "train/train_step.h"
#include "step_config.h"
#include "thread_comm.h"
#include "test_util.h"

using namespace sigma;
using sigma::testing::append_floats;
using sigma::testing::same_bits;

namespace {

// router: "rre", or the learned-gate baseline "top1" / "top2" (capacity 1.25: some drops).
ModelConfig ep_config(const char* router = "rre") {
  ModelConfig c = sigma::testing::step_config(2);
  c.router = router;
  return c;
}

// `n` micro-batches of 3 rows; domain_of(i, row) gives each row's domain.
template <class DomainOf>
std::vector<Batch> batches(const ModelConfig& c, int n, uint64_t seed, DomainOf domain_of) {
  std::vector<Batch> out(static_cast<size_t>(n));
  Rng r(seed, 1);
  for (int i = 0; i < n; ++i) {
    Batch& b = out[size_t(i)];
    b.resize(3, c.context);
    for (auto& t : b.tokens) t = int32_t(r.below(uint64_t(c.vocab)));
    for (auto& t : b.targets) t = int32_t(r.below(uint64_t(c.vocab)));
    for (int row = 0; row < b.B; ++row) b.domain[size_t(row)] = domain_of(i, row, r);
    b.mask[2] = 0.0f;
  }
  return out;
}
std::vector<Batch> mixed(const ModelConfig& c, int n, uint64_t seed) {
  return batches(c, n, seed, [](int, int, Rng& r) { return int32_t(r.below(2)); });
}
// Rows 0 and 1 of domains a and b, row 2 either.
std::vector<Batch> both(const ModelConfig& c, int n, uint64_t seed) {
  return batches(c, n, seed, [](int, int row, Rng& r) { return int32_t(row < 2 ? row : r.below(2)); });
}
// The first half of the micro-batches domain a, the second half b.
std::vector<Batch> halves(const ModelConfig& c, int n, uint64_t seed) {
  return batches(c, n, seed, [n](int i, int, Rng&) { return int32_t(i < n / 2 ? 0 : 1); });
}

using ExpertKey = std::tuple<int, int, int>;  // (block, group, expert)
struct Trained {
  std::vector<float> shared;                       // rank 0's model parameters
  std::map<ExpertKey, std::vector<float>> experts;  // weights, m, v and step of every expert
  std::vector<double> losses, norms;
  std::vector<std::vector<CommStats>> traffic;     // [rank][group]
};

Trained train_ep(int R, const GroupPlacement& placement, int steps, int micro,
                 std::vector<Batch> (*make)(const ModelConfig&, int, uint64_t), int threads = 1,
                 const char* router = "rre") {
  Trained out;
  out.traffic.resize(size_t(R));
  std::mutex mu;
  test_ranks::run_ranks(R, [&](Communicator& comm) {
    omp_set_num_threads(threads);
    const ModelConfig c = ep_config(router);
    Model m(c, 5, nullptr, /*external_experts=*/true);
    OptimConfig oc;
    oc.lr = 1e-2f;
    oc.grad_clip = 0.05f;  // clipping on: the norm must agree across ranks too
    ExpertParallel ep(m, comm, placement, oc, "", false);
    const ShardPlan plan = plan_shards(m.params(), R);
    AdamW opt(oc, m.params(), R > 1 ? plan.owned_by(comm.rank()) : std::vector<ParamPiece>{});
    TrainStep step(m, opt, comm, oc, plan);
    for (int s = 0; s < steps; ++s) {
      const auto mb = make(c, micro, uint64_t(s) + 1);
      step.prepare(mb);
      const StepResult r = step.run(mb, oc.lr, UpdateMask{});
      if (comm.rank() == 0) {
        out.losses.push_back(r.loss);
        out.norms.push_back(r.grad_norm);
      }
    }
    std::lock_guard<std::mutex> lock(mu);
    out.traffic[size_t(comm.rank())] = ep.group_traffic();
    if (comm.rank() == 0)
      for (const Param& p : m.params().all())
        append_floats(out.shared, p.value);
    if (!ep.store()) return;
    const ExpertStore& st = *ep.store();
    for (const ExpertGroupSpec& gs : st.spec().groups)
      for (int32_t k = 0; k < gs.experts; ++k) {
        const ExpertId id{gs.block, gs.group, k};
        std::vector<float> rec(st.weights(id), st.weights(id) + gs.params());
        rec.insert(rec.end(), st.m(id), st.m(id) + gs.params());
        rec.insert(rec.end(), st.v(id), st.v(id) + gs.params());
        rec.push_back(float(st.step(id)));
        out.experts[{gs.block, gs.group, ep.first_held(gs.group) + k}] = std::move(rec);
      }
  });
  return out;
}

// `steps` one-process training steps of m, a micro-batch each from make; their losses.
std::vector<double> train_one_process(Model& m, const OptimConfig& oc, int steps,
                                      std::vector<Batch> (*make)(const ModelConfig&, int, uint64_t)) {
  SingleProcess comm;
  AdamW opt(oc, m.params());
  TrainStep step(m, opt, comm, oc, plan_shards(m.params(), 1));
  std::vector<double> losses;
  for (int s = 0; s < steps; ++s) {
    const auto mb = make(m.config(), 1, uint64_t(s) + 1);
    step.prepare(mb);
    losses.push_back(step.run(mb, oc.lr, UpdateMask{}).loss);
  }
  return losses;
}

void expect_same(const Trained& a, const Trained& b, const std::string& what) {
  EXPECT_TRUE(same_bits(a.shared, b.shared)) << what << ": shared weights";
  ASSERT_EQ(a.experts.size(), b.experts.size()) << what;
  for (const auto& [key, rec] : a.experts)
    EXPECT_TRUE(same_bits(rec, b.experts.at(key))) << what << ": expert " << std::get<0>(key)
                                                    << "." << std::get<1>(key) << "." << std::get<2>(key);
  EXPECT_EQ(a.losses, b.losses) << what;
  EXPECT_EQ(a.norms, b.norms) << what;
}

}  // namespace

// Every group spread over every rank (K = 2 over 4 ranks: two ranks hold none of group b),
// micro-batches of mixed domains: 1, 2 and 4 ranks train the same bits, experts included.
TEST(ExpertParallel, OneTwoAndFourRanksTrainBitIdentically) {
  const Trained one = train_ep(1, GroupPlacement::everywhere(2, 1), 4, 4, mixed);
  ASSERT_EQ(one.experts.size(), 2u * 5u);
  for (int R : {2, 4}) {
    const Trained many = train_ep(R, GroupPlacement::everywhere(2, R), 4, 4, mixed);
    expect_same(one, many, std::to_string(R) + " ranks");
  }
  // Two threads per rank: the holder runs each source's experts side by side or each over all
  // threads exactly as that source's whole pass would in one process.
  const Trained one2 = train_ep(1, GroupPlacement::everywhere(2, 1), 3, 2, mixed, 2);
  expect_same(one2, train_ep(2, GroupPlacement::everywhere(2, 2), 3, 2, mixed, 2), "2 ranks x 2 threads");
}

// Groups on different rank sets: group a's micro-batches run on the first half of the ranks,
// group b's on the second, and each group's experts live only there. Rows never reach a rank
// outside their group, and the bits are still those of one process.
TEST(ExpertParallel, GroupsOnTheirOwnRanksExchangeOnlyInsideTheGroup) {
  const Trained one = train_ep(1, GroupPlacement::everywhere(2, 1), 4, 4, halves);
  const Trained two = train_ep(2, GroupPlacement{{{0}, {1}}}, 4, 4, halves);
  const GroupPlacement split{{{0, 1}, {2, 3}}};
  const Trained four = train_ep(4, split, 4, 4, halves);
  expect_same(one, two, "2 ranks, a group each");
  expect_same(one, four, "4 ranks, two per group");
  for (int r = 0; r < 4; ++r)
    for (int g = 0; g < 2; ++g) {
      const CommStats& s = four.traffic[size_t(r)][size_t(g)];
      const bool member = std::count(split.ranks[size_t(g)].begin(), split.ranks[size_t(g)].end(), r) > 0;
      if (!member) {
        EXPECT_EQ(s.calls, 0) << "rank " << r << " is not in group " << g;
        continue;
      }
      ASSERT_EQ(s.bytes_to.size(), 4u);
      for (int q = 0; q < 4; ++q) {
        const bool q_member = std::count(split.ranks[size_t(g)].begin(), split.ranks[size_t(g)].end(), q) > 0;
        if (!q_member) {
          EXPECT_EQ(s.bytes_to[size_t(q)], 0) << "group " << g << ": rank " << r << " -> " << q;
        }
      }
      const int peer = split.ranks[size_t(g)][split.ranks[size_t(g)][0] == r ? 1 : 0];
      EXPECT_GT(s.bytes_to[size_t(peer)], 0) << "rank " << r << " exchanged nothing with " << peer;
    }
}

// The learned top-2 gate, the baseline RRE is measured against, through the same executor:
// each gated block first exchanges its rows per expert inside the group (one all-gather: five
// collectives per block and group where RRE needs four), and 1, 2 and 4 ranks still train the
// same bits, with the groups spread or on their own ranks.
TEST(ExpertParallel, ALearnedGateTrainsTheSameBitsOnOneTwoAndFourRanks) {
  for (const char* router : {"top2", "top1"}) {
    const Trained one = train_ep(1, GroupPlacement::everywhere(2, 1), 3, 4, mixed, 1, router);
    for (int R : {2, 4})
      expect_same(one, train_ep(R, GroupPlacement::everywhere(2, R), 3, 4, mixed, 1, router),
                  std::string(router) + ", " + std::to_string(R) + " ranks");
  }
  const Trained one = train_ep(1, GroupPlacement::everywhere(2, 1), 3, 4, halves, 1, "top2");
  const Trained four = train_ep(4, GroupPlacement{{{0, 1}, {2, 3}}}, 3, 4, halves, 1, "top2");
  expect_same(one, four, "top2, 4 ranks, two per group");
  const Trained rre = train_ep(4, GroupPlacement{{{0, 1}, {2, 3}}}, 3, 4, halves);
  for (int r = 0; r < 4; ++r)
    for (int g = 0; g < 2; ++g)
      EXPECT_EQ(four.traffic[size_t(r)][size_t(g)].calls * 4, rre.traffic[size_t(r)][size_t(g)].calls * 5)
          << "rank " << r << ", group " << g;
}

// train.experts for a learned gate: expert parallel on several ranks (auto) or when asked,
// in the model on one rank; never ECSS, whose step gathers its experts before the pass.
TEST(ExpertParallel, ALearnedGateTrainsInParallelOrInTheModel) {
  const ModelConfig c = ep_config("top2");
  EXPECT_EQ(resolve_expert_mode("auto", c, 1), ExpertMode::InModel);
  EXPECT_EQ(resolve_expert_mode("auto", c, 2), ExpertMode::Parallel);
  EXPECT_EQ(resolve_expert_mode("parallel", c, 1), ExpertMode::Parallel);
  for (const char* mode : {"ecss", "vanilla"}) {
    try {
      resolve_expert_mode(mode, c, 1);
      ADD_FAILURE() << mode << " accepted a learned gate";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("router = top2"), std::string::npos) << e.what();
    }
  }
}

// On one rank the gate's expert-parallel step computes what the in-model gate computes (the
// same forward and gradients; the optimizers differ only in the experts' lazy Adam state,
// equal while every expert receives rows: both domains in every batch), so the losses agree to
// rounding.
TEST(ExpertParallel, OneRankOfTheGateMatchesTheInModelGate) {
  const ModelConfig c = ep_config("top2");
  OptimConfig oc;
  oc.lr = 1e-2f;
  oc.weight_decay = 0.0f;
  std::vector<std::vector<double>> losses(2);
  for (int run = 0; run < 2; ++run) {
    omp_set_num_threads(1);
    Model m(c, 5, nullptr, /*external_experts=*/run == 0);
    SingleProcess comm;
    std::unique_ptr<ExpertParallel> ep;
    if (run == 0) ep = std::make_unique<ExpertParallel>(m, comm, GroupPlacement::everywhere(2, 1), oc, "", false);
    losses[size_t(run)] = train_one_process(m, oc, 4, both);
  }
  ASSERT_EQ(losses[0].size(), 4u);
  for (size_t s = 0; s < 4; ++s)
    EXPECT_NEAR(losses[0][s], losses[1][s], 1e-5 * std::abs(losses[1][s])) << "step " << s;
  EXPECT_NE(losses[0].front(), losses[0].back());  // it trains
}

// One process, one micro-batch a step: expert parallelism is ECSS (the same lazy Adam on the
// same gradients), so it trains the bits an ECSS run trains.
TEST(ExpertParallel, OneRankMatchesEcss) {
  const ModelConfig c = ep_config();
  OptimConfig oc;
  oc.lr = 1e-2f;
  std::vector<std::vector<float>> shared(2);
  std::vector<std::vector<double>> losses(2);
  for (int run = 0; run < 2; ++run) {
    omp_set_num_threads(1);
    Model m(c, 5, nullptr, true);
    SingleProcess comm;
    std::unique_ptr<ExpertExecutor> ex;
    if (run == 0) ex = std::make_unique<ExpertParallel>(m, comm, GroupPlacement::everywhere(2, 1), oc, "", false);
    else ex = std::make_unique<EcssExperts>(m, ExpertMode::Ecss, oc, "", false, int64_t(1) << 30);
    losses[size_t(run)] = train_one_process(m, oc, 5, mixed);
    for (const Param& p : m.params().all())
      append_floats(shared[size_t(run)], p.value);
  }
  EXPECT_EQ(losses[0], losses[1]);
  EXPECT_TRUE(same_bits(shared[0], shared[1]));
}

// Checkpoint files: each (RRE block, group) pair is written by one rank of its group, the
// blocks taking the group's ranks in turn, and every rank agrees on who writes what (rank 0
// records the others' files in the manifest from that list).
TEST(ExpertParallel, EachGroupsCheckpointFilesAreWrittenByItsOwnRanksInTurn) {
  const GroupPlacement split{{{0, 1}, {2, 3}}};
  std::vector<std::vector<std::vector<std::string>>> views(4);  // [viewer][rank] files
  std::mutex mu;
  test_ranks::run_ranks(4, [&](Communicator& comm) {
    omp_set_num_threads(1);
    Model m(ep_config(), 5, nullptr, true);
    ExpertParallel ep(m, comm, split, OptimConfig{}, "", false);
    std::lock_guard<std::mutex> lock(mu);
    for (int r = 0; r < 4; ++r) views[size_t(comm.rank())].push_back(ep.files_of_rank(r));
    for (int l = 1; l < 3; ++l)
      for (int g = 0; g < 2; ++g)
        EXPECT_EQ(ep.writer_of(l, g), split.ranks[size_t(g)][size_t(l - 1 + g) % 2]);
  });
  for (int v = 1; v < 4; ++v) EXPECT_EQ(views[size_t(v)], views[0]) << "rank " << v << "'s view";
  // Each rank writes one (block, group) pair, two files.
  EXPECT_EQ(views[0][0], (std::vector<std::string>{"experts.1.a.safetensors", "experts.1.a.adam.safetensors"}));
  EXPECT_EQ(views[0][1], (std::vector<std::string>{"experts.2.a.safetensors", "experts.2.a.adam.safetensors"}));
  EXPECT_EQ(views[0][2], (std::vector<std::string>{"experts.2.b.safetensors", "experts.2.b.adam.safetensors"}));
  EXPECT_EQ(views[0][3], (std::vector<std::string>{"experts.1.b.safetensors", "experts.1.b.adam.safetensors"}));
}

// A rank handed rows of a group it is not placed with says so instead of exchanging them.
TEST(ExpertParallel, ARowOfAGroupPlacedElsewhereIsAnError) {
  test_ranks::run_ranks(2, [&](Communicator& comm) {
    omp_set_num_threads(1);
    const ModelConfig c = ep_config();
    Model m(c, 5, nullptr, true);
    OptimConfig oc;
    ExpertParallel ep(m, comm, GroupPlacement{{{0}, {1}}}, oc, "", false);
    const ShardPlan plan = plan_shards(m.params(), 2);
    AdamW opt(oc, m.params(), plan.owned_by(comm.rank()));
    TrainStep step(m, opt, comm, oc, plan);
    const auto mb = mixed(c, 2, 3);
    try {
      step.prepare(mb);
      FAIL() << "rank " << comm.rank() << " accepted rows of the other group";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("not placed on this rank"), std::string::npos) << e.what();
    }
  });
}

// The run's log line on where groups lie by host: by_group on hosts of 2 keeps each group on
// one host; spread puts every group on both; one host says nothing.
TEST(ExpertParallel, GroupsByHostSayWhichGroupsCrossHosts) {
  const std::vector<std::string> names{"copy", "arith", "markov"};
  const std::vector<std::string> two_hosts{"h0", "h0", "h1", "h1"};
  const GroupPlacement by_group = GroupPlacement::by_group(3, 4, 4);
  ASSERT_EQ(by_group.ranks, (std::vector<std::vector<int>>{{0, 1}, {2}, {3}}));
  const std::string inside = describe_groups_by_host(by_group, names, two_hosts);
  EXPECT_NE(inside.find("copy on h0 (ranks 0-1), arith on h1 (rank 2), markov on h1 (rank 3)"),
            std::string::npos) << inside;
  EXPECT_NE(inside.find("stays inside its host"), std::string::npos) << inside;
  const std::string across = describe_groups_by_host(GroupPlacement::everywhere(3, 4), names, two_hosts);
  EXPECT_NE(across.find("copy on h0+h1 (ranks 0-3)"), std::string::npos) << across;
  EXPECT_NE(across.find("3 of 3 groups span hosts"), std::string::npos) << across;
  // Hosts of one rank each: a group on ranks {0, 1} spans two hosts.
  const std::string one_each = describe_groups_by_host(by_group, names, {"a", "b", "c", "d"});
  EXPECT_NE(one_each.find("1 of 3 groups span hosts"), std::string::npos) << one_each;
  EXPECT_EQ(describe_groups_by_host(by_group, names, {"h", "h", "h", "h"}), "");
  // A placement naming ranks the host list does not have is an error, not a read past it.
  EXPECT_THROW(describe_groups_by_host(by_group, names, {"h0", "h1"}), Error);
}
