// The MPI all-reduce as reduce-scatter + all-gather (dist/mpi_communicator.cpp): the same bits
// as adding every rank's part by tree_sum in rank order (the way it was done before, and what
// a one-process run adds), on 2, 3 and 4 ranks, sizes that R does not divide, and chunks
// smaller than the vector; and each rank sends 2(R-1)/R of the vector, not R-1 copies of it.
#include <gtest/gtest.h>
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "cli_util.h"
#include "core/rng.h"
#include "device_access.h"
#include "dist/communicator.h"
#include "model/model.h"
#include "optim/adamw.h"
#include "parallel/grid.h"
#include "parallel/shard_plan.h"
#include "thread_comm.h"
#include "train/train_step.h"

using namespace sigma;
using namespace sigma::testing;

namespace {

#define SKIP_WITHOUT_MPI() \
  if (!SIGMA_HAS_MPI) GTEST_SKIP() << "built with SIGMA_MPI=OFF: reconfigure with -DSIGMA_MPI=ON"

// Rank r's part, element i: magnitudes over 2^-20..2^20 and both signs, so that any other
// bracketing of the sum changes bits.
template <class T>
T part(int r, size_t i) {
  uint64_t h = (uint64_t(r) * 0x9E3779B97F4A7C15ull) ^ (uint64_t(i) * 0xBF58476D1CE4E5B9ull);
  h ^= h >> 31;
  h *= 0x94D049BB133111EBull;
  h ^= h >> 29;
  const double m = double(h % 1000003) / 1000003.0 + 0.5;
  const int e = int((h >> 20) % 41) - 20;
  return T(((h >> 40) & 1 ? -m : m) * std::ldexp(1.0, e));
}

// Runs the CollectivesChild tests of this binary under mpirun -np R (`env`: more variables).
void run_children(int R, const std::string& env = "") {
  SKIP_WITHOUT_MPI();
  const CmdResult r = run_cmd(
      env + " SIGMA_TEST_CHILD=1 timeout 120 mpirun --allow-run-as-root --oversubscribe --bind-to none -np " +
      std::to_string(R) + " /proc/" + std::to_string(getpid()) + "/exe --gtest_color=no " +
      "--gtest_filter=CollectivesChild.* 2>&1");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("[  PASSED  ] 1 test"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("FAILED"), std::string::npos) << r.out;
}

template <class T>
void check_all_reduce(sigma::Communicator& c) {
  const int R = c.size(), me = c.rank();
  for (size_t chunk : {size_t(1) << 30, size_t(7), size_t(2)}) {
    sigma::set_max_message_elements(chunk);
    for (size_t n : {size_t(0), size_t(1), size_t(2), size_t(3), size_t(5), size_t(13), size_t(101),
                     size_t(4099)}) {
      std::vector<T> all(size_t(R) * n), want(n), got(n);
      std::vector<const T*> p(static_cast<size_t>(R));
      for (int r = 0; r < R; ++r) {
        for (size_t i = 0; i < n; ++i) all[size_t(r) * n + i] = part<T>(r, i);
        p[size_t(r)] = all.data() + size_t(r) * n;
      }
      sigma::tree_sum(want.data(), p.data(), R, int64_t(n));
      for (size_t i = 0; i < n; ++i) got[i] = part<T>(me, i);
      const std::vector<int64_t> before = c.stats().bytes_to;
      c.all_reduce_sum(got.data(), n);
      for (size_t i = 0; i < n; ++i)  // bit for bit (EXPECT_EQ on floats compares exactly)
        ASSERT_EQ(got[i], want[i]) << "R " << R << " n " << n << " chunk " << chunk << " i " << i;
      // Bytes to the other ranks: this rank's share of each chunk's pieces, twice.
      int64_t sent = 0;
      for (int r = 0; r < R; ++r)
        if (r != me)
          sent += c.stats().bytes_to[size_t(r)] - (before.empty() ? 0 : before[size_t(r)]);
      const size_t len = std::min(n, chunk), chunks = len ? (n + len - 1) / len : 0;
      const int64_t bound = int64_t(2 * size_t(R - 1) * (len / size_t(R) + 1) * chunks * sizeof(T));
      EXPECT_LE(sent, bound) << "R " << R << " n " << n << " chunk " << chunk;
      if (R >= 3 && n >= size_t(4 * R) && chunk > n) {  // gathering every part: (R - 1) n elements
        EXPECT_LT(sent, int64_t(size_t(R - 1) * n * sizeof(T))) << "R " << R << " n " << n;
      }
    }
  }
  sigma::set_max_message_elements(size_t(1) << 30);
}

// Under faked hosts (SIGMA_TEST_HOSTS): the reduce-scatter-v and the all-gather-v, blocking and
// non-blocking (three in flight at once, completed newest first), give tree_sum's bits and the
// pieces exactly, and the bytes that leave the busiest host are SIGMA_TEST_EXPECT_CROSS's
// ("sums,gathers": fractions of the vector), with the path the line at start names.
void check_host_first(sigma::Communicator& c) {
  const int R = c.size(), me = c.rank();
  std::vector<int> host;
  for (const char* p = std::getenv("SIGMA_TEST_HOSTS"); *p;) {
    char* end = nullptr;
    host.push_back(int(std::strtol(p, &end, 10)));
    p = *end == ',' ? end + 1 : end;
  }
  ASSERT_EQ(host.size(), size_t(R));
  const std::string layout = c.host_layout();
  const std::string want_path = std::getenv("SIGMA_TEST_EXPECT_PATH");
  EXPECT_NE(layout.find(want_path), std::string::npos) << layout;
  double want_sums = 0, want_gathers = 0;
  ASSERT_EQ(std::sscanf(std::getenv("SIGMA_TEST_EXPECT_CROSS"), "%lf,%lf", &want_sums, &want_gathers), 2);
  // Bytes this rank sent to other hosts since `before`, then the busiest host's.
  auto busiest = [&](const std::vector<int64_t>& before) {
    double mine = 0;
    for (int r = 0; r < R; ++r)
      if (host[size_t(r)] != host[size_t(me)])
        mine += double(c.stats().bytes_to[size_t(r)] - (before.empty() ? 0 : before[size_t(r)]));
    std::vector<double> all(static_cast<size_t>(R));
    c.all_gather(all.data(), &mine, 1);
    std::vector<double> per_host(size_t(R), 0);
    for (int r = 0; r < R; ++r) per_host[size_t(host[size_t(r)])] += all[size_t(r)];
    return *std::max_element(per_host.begin(), per_host.end());
  };
  std::vector<int64_t> counts(static_cast<size_t>(R));
  for (int r = 0; r < R; ++r) counts[size_t(r)] = 5 + 3 * r;
  int64_t total = 0;
  std::vector<int64_t> at(static_cast<size_t>(R));
  for (int r = 0; r < R; ++r) at[size_t(r)] = total, total += counts[size_t(r)];
  // Parts: in[o] is this rank's part for owner o (op k's values).
  auto input = [&](int rank, int k) {
    std::vector<float> x(static_cast<size_t>(total));
    for (int64_t i = 0; i < total; ++i) x[size_t(i)] = part<float>(rank + 17 * k, size_t(i));
    return x;
  };
  auto want_sum = [&](int k) {
    std::vector<std::vector<float>> all;
    std::vector<const float*> p;
    for (int r = 0; r < R; ++r) all.push_back(input(r, k));
    for (int r = 0; r < R; ++r) p.push_back(all[size_t(r)].data() + at[size_t(me)]);
    std::vector<float> w(static_cast<size_t>(counts[size_t(me)]));
    tree_sum(w.data(), p.data(), R, int64_t(w.size()));
    return w;
  };
  for (int k = 0; k < 2; ++k) {
    const std::vector<float> in = input(me, k);
    std::vector<float> out(static_cast<size_t>(counts[size_t(me)]), -1.0f);
    c.reduce_scatter_sum_v(out.data(), in.data(), counts.data());
    EXPECT_EQ(0, std::memcmp(out.data(), want_sum(k).data(), out.size() * 4)) << "blocking, op " << k;
  }
  {  // three non-blocking at once, completed in reverse
    std::vector<std::vector<float>> in, out;
    std::vector<std::unique_ptr<PendingOp>> ops;
    for (int k = 0; k < 3; ++k) {
      in.push_back(input(me, k));
      out.emplace_back(size_t(counts[size_t(me)]), -1.0f);
    }
    for (int k = 0; k < 3; ++k)
      ops.push_back(c.start_reduce_scatter_sum_v(out[size_t(k)].data(), in[size_t(k)].data(), counts.data()));
    for (int k = 2; k >= 0; --k) ops[size_t(k)]->wait();
    for (int k = 0; k < 3; ++k)
      EXPECT_EQ(0, std::memcmp(out[size_t(k)].data(), want_sum(k).data(), out[size_t(k)].size() * 4))
          << "non-blocking, op " << k;
  }
  {  // gathers, blocking and non-blocking
    std::vector<float> mine(static_cast<size_t>(counts[size_t(me)])), got(static_cast<size_t>(total)),
        got2(static_cast<size_t>(total));
    for (size_t i = 0; i < mine.size(); ++i) mine[i] = part<float>(me, i);
    c.all_gather_v(got.data(), mine.data(), counts.data());
    c.start_all_gather_v(got2.data(), mine.data(), counts.data())->wait();
    for (int r = 0; r < R; ++r)
      for (int64_t i = 0; i < counts[size_t(r)]; ++i) {
        ASSERT_EQ(got[size_t(at[size_t(r)] + i)], part<float>(r, size_t(i))) << "rank " << r;
        ASSERT_EQ(got2[size_t(at[size_t(r)] + i)], part<float>(r, size_t(i))) << "rank " << r;
      }
  }
  // The bytes of one even reduce-scatter and one even all-gather of a vector of R * n.
  const size_t n = 1000;
  std::vector<float> v(size_t(R) * n, 1.0f), o(n);
  std::vector<int64_t> before = c.stats().bytes_to;
  c.reduce_scatter_sum(o.data(), v.data(), n);
  const double sums = busiest(before) / double(v.size() * 4);
  before = c.stats().bytes_to;
  c.all_gather(v.data(), o.data(), n);
  const double gathers = busiest(before) / double(v.size() * 4);
  EXPECT_NEAR(sums, want_sums, 1e-9) << layout;
  EXPECT_NEAR(gathers, want_gathers, 1e-9) << layout;
}

// Three training steps of a small model split over one tp group of all the world's ranks (dense
// and one RRE layer, experts in the model, clipping on): each rank's losses, gradient norms
// and a hash of its weights, in a line to compare bit for bit.
std::string tp_training(Communicator& world, int rre_layers) {
  omp_set_num_threads(1);  // kernels are deterministic for a given thread count
  ModelConfig c;
  c.vocab = 40;
  c.d_model = 16;
  c.heads = 4;
  c.context = 6;
  c.layers = 3;
  c.slots = 2;
  c.init_std = 0.3f;
  c.domains = {{"a", "a", 0}, {"b", "b", 1}};
  c.rre_layers = rre_layers;
  if (rre_layers) c.groups = {{"a", 2}, {"b", 3}};
  RankGrid grid(world, world.size());
  Model m(c, 42, nullptr, false, grid.tp_group());
  OptimConfig oc;
  oc.lr = 1e-2f;
  oc.grad_clip = 0.05f;
  const ShardPlan plan = plan_shards(m.params(), 1);
  AdamW opt(oc, m.params());
  TrainStep step(m, opt, grid.data(), oc, plan);
  if (world.size() > 1) step.set_tensor_parallel(&grid.tensor());
  std::string out;
  for (int s = 0; s < 3; ++s) {
    Batch b;
    b.resize(3, 5);
    Rng r(5 + uint64_t(s), 1);
    for (auto& t : b.tokens) t = int32_t(r.below(uint64_t(c.vocab)));
    for (auto& t : b.targets) t = int32_t(r.below(uint64_t(c.vocab)));
    for (int i = 0; i < 3; ++i) b.domain[size_t(i)] = i % 2;
    std::vector<Batch> mb{b};
    step.prepare(mb);
    const StepResult res = step.run(mb, oc.lr, UpdateMask{});
    out += fmt::format("{:a} {:a} ", res.loss, res.grad_norm);
  }
  uint64_t h = 1469598103934665603ull;  // FNV-1a over every weight's bits
  for (const Param& p : m.params().all())
    for (float v : host_floats(p.value)) {
      uint32_t u;
      std::memcpy(&u, &v, 4);
      h = (h ^ u) * 1099511628211ull;
    }
  return out + fmt::format("{:016x}", h);
}

// tp = R on MPI (the reduce-scatter + all-gather) against the thread ranks of
// tests/thread_comm.h, whose all-reduce gathers every part and adds them by tree_sum in rank
// order (the MPI communicator's way before): the same bits on every rank.
void tp_training_matches_gather_and_sum(int R) {
  SKIP_WITHOUT_MPI();
  TempDir t("tp_bits");
  run_children(R, "SIGMA_TEST_TP_OUT=" + t.str());
  for (int rre : {0, 1}) {
    std::vector<std::string> want(static_cast<size_t>(R));
    test_ranks::run_ranks(R, [&](Communicator& w) { want[size_t(w.rank())] = tp_training(w, rre); });
    for (int r = 0; r < R; ++r) {
      std::ifstream in(t / fmt::format("rre{}.rank{}", rre, r));
      std::stringstream got;
      got << in.rdbuf();
      EXPECT_EQ(got.str(), want[size_t(r)]) << "tp " << R << ", rre_layers " << rre << ", rank " << r;
    }
  }
}

}  // namespace

TEST(Collectives, Tp2TrainingGivesTheBitsOfGatherAndSum) { tp_training_matches_gather_and_sum(2); }
TEST(Collectives, Tp4TrainingGivesTheBitsOfGatherAndSum) { tp_training_matches_gather_and_sum(4); }

TEST(Collectives, AllReduceKeepsTheBitsOnTwoRanks) { run_children(2); }
TEST(Collectives, AllReduceKeepsTheBitsAndMovesLessOnThreeRanks) { run_children(3); }
TEST(Collectives, AllReduceKeepsTheBitsAndMovesHalfOnFourRanks) { run_children(4); }

// Faked hosts (SIGMA_TEST_HOSTS; the simulated cluster has real ones): 4 ranks as 2 hosts of
// 2, aligned with the tree ((0 1) (2 3)): sums and gathers host-first, half the bytes out of a
// host; 3 ranks as hosts {0} {1, 2}, not aligned with ((0 1) 2): sums direct (the same bytes),
// gathers host-first. Every all-reduce of the bit checks above runs on the same paths.
TEST(Collectives, HostFirstSumsKeepTheBitsOnTwoFakedHostsOfTwo) {
  run_children(4, "SIGMA_TEST_HOSTS=0,0,1,1 SIGMA_TEST_EXPECT_PATH='sums host-first' "
                  "SIGMA_TEST_EXPECT_CROSS=0.5,0.5");
}
TEST(Collectives, FakedHostsUnalignedWithTheTreeSumDirect) {
  run_children(3, "SIGMA_TEST_HOSTS=0,1,1 SIGMA_TEST_EXPECT_PATH='sums direct: no host holds' "
                  "SIGMA_TEST_EXPECT_CROSS=0.6666666666666666,0.6666666666666666");
}
TEST(Collectives, HostFirstSwitchedOffSendsEveryPartDirect) {
  run_children(4, "SIGMA_HOST_FIRST=0 SIGMA_TEST_HOSTS=0,0,1,1 "
                  "SIGMA_TEST_EXPECT_PATH='sums direct (SIGMA_HOST_FIRST=0)' SIGMA_TEST_EXPECT_CROSS=1,1");
}

TEST(CollectivesChild, AllReduceIsTreeSumInRankOrder) {
  if (!std::getenv("SIGMA_TEST_CHILD")) GTEST_SKIP() << "started by Collectives.AllReduce...";
  auto world = sigma::make_world(60);
  if (std::getenv("SIGMA_TEST_HOSTS")) check_host_first(*world);
  check_all_reduce<float>(*world);
  check_all_reduce<double>(*world);
  if (const char* dir = std::getenv("SIGMA_TEST_TP_OUT"))
    for (int rre : {0, 1}) {
      const std::string line = tp_training(*world, rre);
      std::ofstream(fmt::format("{}/rre{}.rank{}", dir, rre, world->rank())) << line;
    }
  world->barrier();
}
