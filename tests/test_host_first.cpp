// Host-first sums and gathers (dist/host_first.h) without MPI: the plan for host layouts
// aligned with tree_sum's rank-order tree, partly aligned and not at all, and every rank's side
// of the collectives run over a simulated network that matches messages as MPI does (in posting
// order per sender, receiver and tag). The sums must be tree_sum's over all ranks' parts bit
// for bit, the gathers exact, and the bytes that leave each host what the plan says. Under
// mpirun with faked hosts: tests/test_collectives.cpp; across network namespaces:
// tests/test_sim_cluster_host_first.sh.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "core/rng.h"
#include "dist/communicator.h"
#include "dist/host_first.h"

using namespace sigma;

namespace {

// The network: messages in flight in posting order, receives posted in posting order. A
// message goes to the earliest open receive of its destination with its source and tag (MPI's
// matching); a send completes at once (the data is copied when posted).
struct SimNet {
  struct Msg {
    int src, dst, tag;
    std::vector<char> bytes;
  };
  struct Recv {
    int dst, src, tag;
    char* data;
    size_t bytes;
    bool done = false;
  };
  std::vector<int> host;             // [rank]
  std::vector<int64_t> out_of_host;  // [host] bytes sent to other hosts
  std::deque<Msg> wire;
  std::deque<std::shared_ptr<Recv>> recvs;
  std::string error;  // a message whose receive expected another size

  void deliver() {
    for (auto m = wire.begin(); m != wire.end();) {
      std::shared_ptr<Recv> to;
      for (auto& r : recvs)
        if (!r->done && r->dst == m->dst && r->src == m->src && r->tag == m->tag) {
          to = r;
          break;
        }
      if (!to) {
        ++m;
        continue;
      }
      if (to->bytes != m->bytes.size() && error.empty())
        error = "rank " + std::to_string(m->src) + " sent " + std::to_string(m->bytes.size()) +
                " bytes on tag " + std::to_string(m->tag) + " to rank " + std::to_string(m->dst) +
                ", which expected " + std::to_string(to->bytes);
      std::memcpy(to->data, m->bytes.data(), std::min(to->bytes, m->bytes.size()));
      to->done = true;
      m = wire.erase(m);
    }
    std::erase_if(recvs, [](const std::shared_ptr<Recv>& r) { return r->done; });
  }
};

class SimMessages final : public Messages {
 public:
  SimMessages(SimNet& net, std::vector<std::shared_ptr<SimNet::Recv>> mine) : net_(net), mine_(std::move(mine)) {}
  bool test() override {
    net_.deliver();
    for (auto& r : mine_)
      if (!r->done) return false;
    return true;
  }
  void wait() override {
    if (!test()) throw std::runtime_error("simulated wait: the messages cannot arrive yet");
  }

 private:
  SimNet& net_;
  std::vector<std::shared_ptr<SimNet::Recv>> mine_;
};

class SimRank final : public PointToPoint {
 public:
  SimRank(SimNet& net, int me) : net_(net), me_(me) {}
  std::unique_ptr<Messages> post(const std::vector<Transfer>& sends,
                                 const std::vector<Transfer>& recvs, size_t elem,
                                 int tag) override {
    std::vector<std::shared_ptr<SimNet::Recv>> mine;
    for (const Transfer& t : recvs) {
      mine.push_back(std::make_shared<SimNet::Recv>(
          SimNet::Recv{me_, t.peer, tag, static_cast<char*>(t.data), t.n * elem}));
      net_.recvs.push_back(mine.back());
    }
    for (const Transfer& t : sends) {
      const char* p = static_cast<const char*>(t.data);
      net_.wire.push_back({me_, t.peer, tag, std::vector<char>(p, p + t.n * elem)});
      if (net_.host[size_t(t.peer)] != net_.host[size_t(me_)])
        net_.out_of_host[size_t(net_.host[size_t(me_)])] += int64_t(t.n * elem);
    }
    return std::make_unique<SimMessages>(net_, std::move(mine));
  }

 private:
  SimNet& net_;
  int me_;
};

// Rank r's value i: magnitudes over 2^-20..2^20 and both signs, so that adding in any other
// order changes bits.
template <class T>
T part(int r, int64_t i, int op) {
  Rng g(uint64_t(r) * 1000003 + uint64_t(i) * 7919 + uint64_t(op) * 104729 + 1, 3);
  const double m = 0.5 + double(g.next_u64() >> 11) / 9007199254740992.0;
  const int e = int(g.below(41)) - 20;
  return T((g.below(2) ? -m : m) * std::ldexp(1.0, e));
}

// Runs `ops` host-first reduce-scatters (sums) or all-gathers on every rank of `host` at once,
// tags per op as the MPI communicator gives them, each rank testing its ops in its own order
// (odd ranks newest first), so that second rounds are posted in different orders on different
// ranks. Checks every result; returns the bytes out of each host.
template <class T>
std::vector<int64_t> run(const std::vector<int>& host, bool sums, const std::vector<int64_t>& counts,
                         int ops = 3) {
  const int P = int(host.size());
  const HostPlan plan(host);
  SimNet net;
  net.host.assign(host.begin(), host.end());
  for (int r = 0; r < P; ++r) net.host[size_t(r)] = plan.host_of(r);
  net.out_of_host.assign(size_t(plan.hosts()), 0);
  std::vector<SimRank> ranks;
  for (int r = 0; r < P; ++r) ranks.emplace_back(net, r);
  int64_t total = 0;
  std::vector<int64_t> at(size_t(P), 0);
  for (int r = 0; r < P; ++r) at[size_t(r)] = total, total += counts[size_t(r)];
  // [op][rank]: the input and the output of each rank's side.
  std::vector<std::vector<std::vector<T>>> in(static_cast<size_t>(ops)), out(static_cast<size_t>(ops));
  std::vector<std::vector<std::unique_ptr<PendingOp>>> pending(static_cast<size_t>(P));
  for (int k = 0; k < ops; ++k) {
    in[size_t(k)].resize(size_t(P));
    out[size_t(k)].resize(size_t(P));
    for (int r = 0; r < P; ++r) {
      std::vector<T>& x = in[size_t(k)][size_t(r)];
      x.resize(size_t(sums ? total : counts[size_t(r)]));
      for (size_t i = 0; i < x.size(); ++i) x[i] = part<T>(r, int64_t(i), k);
      out[size_t(k)][size_t(r)].assign(size_t(sums ? counts[size_t(r)] : total), T(-7));
    }
    for (int r = 0; r < P; ++r) {
      T* o = out[size_t(k)][size_t(r)].data();
      const T* i = in[size_t(k)][size_t(r)].data();
      const int t1 = host_first_tag(k, 0), t2 = host_first_tag(k, 1);
      if (sums)
        pending[size_t(r)].push_back(std::make_unique<HostFirstReduce<T>>(ranks[size_t(r)], plan, r, o, i, counts.data(), t1, t2));
      else
        pending[size_t(r)].push_back(std::make_unique<HostFirstGather<T>>(ranks[size_t(r)], plan, r, o, i, counts.data(), t1, t2));
    }
  }
  for (int sweep = 0;; ++sweep) {
    bool all = true;
    for (int r = 0; r < P; ++r)
      for (int j = 0; j < ops; ++j) {
        const int k = r % 2 ? ops - 1 - j : j;
        all = pending[size_t(r)][size_t(k)]->test() && all;
      }
    EXPECT_EQ(net.error, "");
    if (all) break;
    if (sweep > 10) {
      ADD_FAILURE() << "the ops did not complete";
      for (auto& p : pending) p.clear();  // (their destructors would wait)
      return {};
    }
  }
  for (int k = 0; k < ops; ++k)
    for (int r = 0; r < P; ++r) {
      const std::vector<T>& got = out[size_t(k)][size_t(r)];
      if (sums) {  // tree_sum of every rank's part for r, in rank order
        std::vector<const T*> p(static_cast<size_t>(P));
        for (int q = 0; q < P; ++q) p[size_t(q)] = in[size_t(k)][size_t(q)].data() + at[size_t(r)];
        std::vector<T> want(got.size());
        if (!want.empty()) tree_sum(want.data(), p.data(), P, int64_t(want.size()));
        EXPECT_EQ(0, std::memcmp(got.data(), want.data(), want.size() * sizeof(T)))
            << "op " << k << ", rank " << r << " of " << P;
      } else {
        for (int q = 0; q < P; ++q)
          EXPECT_EQ(0, std::memcmp(got.data() + at[size_t(q)], in[size_t(k)][size_t(q)].data(),
                                   size_t(counts[size_t(q)]) * sizeof(T)))
              << "op " << k << ", rank " << r << "'s copy of rank " << q << "'s piece";
      }
    }
  for (auto& b : net.out_of_host) b /= ops;
  return net.out_of_host;
}

}  // namespace

TEST(HostPlan, AlignedHostsAddTheirRanksFirstAndSendHalfAcrossHosts) {
  // tp 1 x dp 4 on 2 hosts of 2 (the simulated cluster): tree ((0 1) (2 3)).
  const HostPlan p({7, 7, 3, 3});
  ASSERT_EQ(p.hosts(), 2);
  ASSERT_EQ(p.blocks().size(), 2u);
  EXPECT_EQ(p.blocks()[0].lo, 0);
  EXPECT_EQ(p.blocks()[0].hi, 2);
  EXPECT_EQ(p.blocks()[1].lo, 2);
  EXPECT_EQ(p.blocks()[1].hi, 4);
  EXPECT_TRUE(p.sums_host_first());
  EXPECT_TRUE(p.gathers_host_first());
  EXPECT_EQ(p.reducer(0, 1), 1);  // an owner in the block adds for itself
  EXPECT_NE(p.reducer(0, 2), p.reducer(0, 3));  // the block's other owners spread over it
  EXPECT_DOUBLE_EQ(p.reduce_cross().direct, 1.0);
  EXPECT_DOUBLE_EQ(p.reduce_cross().host_first, 0.5);
  EXPECT_DOUBLE_EQ(p.gather_cross().direct, 1.0);
  EXPECT_DOUBLE_EQ(p.gather_cross().host_first, 0.5);
  EXPECT_NE(p.describe().find("4 ranks on 2 hosts (ranks 0-1 | 2-3): sums host-first"),
            std::string::npos) << p.describe();
}

TEST(HostPlan, UnalignedHostsFallBackToDirectSumsAndSaySo) {
  // Tree ((0 1) 2): host {1, 2} holds no subtree of two ranks.
  const HostPlan p({0, 1, 1});
  EXPECT_EQ(p.blocks().size(), 3u);
  EXPECT_FALSE(p.sums_host_first());
  EXPECT_TRUE(p.gathers_host_first());  // a gather's order is free
  EXPECT_DOUBLE_EQ(p.reduce_cross().host_first, p.reduce_cross().direct);
  EXPECT_NE(p.describe().find("sums direct: no host holds two ranks that tree_sum adds first"),
            std::string::npos) << p.describe();
  // Ranks dealt round-robin over two hosts: no pair of the tree on one host either.
  EXPECT_FALSE(HostPlan({0, 1, 0, 1}).sums_host_first());
  // Switched off: direct, and the line says what host-first would send.
  const HostPlan off({0, 0, 1, 1}, false);
  EXPECT_FALSE(off.sums_host_first());
  EXPECT_FALSE(off.gathers_host_first());
  EXPECT_NE(off.describe().find("sums direct (SIGMA_HOST_FIRST=0): 1.00 of the vector out of the "
                                "busiest host per reduce-scatter, host-first would send 0.50"),
            std::string::npos) << off.describe();
}

TEST(HostPlan, PartlyAlignedHostsAddTheSubtreesTheyHold) {
  // 6 ranks on 2 hosts of 3: tree (((0 1) (2 3)) (4 5)); host 0 holds (0 1) and 2, host 1
  // holds 3 and (4 5).
  const HostPlan p({0, 0, 0, 1, 1, 1});
  ASSERT_EQ(p.blocks().size(), 4u);
  EXPECT_TRUE(p.sums_host_first());
  EXPECT_DOUBLE_EQ(p.reduce_cross().direct, 1.5);      // 3 ranks x 3 owners away / 6
  EXPECT_DOUBLE_EQ(p.reduce_cross().host_first, 1.0);  // 2 blocks x 3 owners away / 6
  EXPECT_DOUBLE_EQ(p.reduce_cross().aligned, 0.5);
}

TEST(HostPlan, OneHostOrOneRankPerHostChangesNothing) {
  EXPECT_EQ(HostPlan({0, 0, 0, 0}).describe(), "");
  EXPECT_FALSE(HostPlan({0, 0, 0, 0}).sums_host_first());
  // The paper's tp 8 x dp 64 on 64 hosts of 8: data rank d is world rank 8d + t, on host d.
  std::vector<int> paper(64);
  for (int d = 0; d < 64; ++d) paper[size_t(d)] = (8 * d + 3) / 8;
  const HostPlan p(paper);
  EXPECT_FALSE(p.sums_host_first());
  EXPECT_FALSE(p.gathers_host_first());
  EXPECT_DOUBLE_EQ(p.reduce_cross().host_first, p.reduce_cross().direct);
  EXPECT_NE(p.describe().find("64 ranks on 64 hosts, one on each: nothing to add or gather inside "
                              "a host, so sums and gathers go direct"), std::string::npos) << p.describe();
  // tp 2 on the same hosts (dp 256): a data group holds 4 ranks of each host, aligned.
  std::vector<int> tp2(256);
  for (int d = 0; d < 256; ++d) tp2[size_t(d)] = (2 * d + 1) / 8;
  const HostPlan q(tp2);
  EXPECT_TRUE(q.sums_host_first());
  EXPECT_DOUBLE_EQ(q.reduce_cross().host_first * 4, q.reduce_cross().direct);
}

TEST(HostFirst, SumsAreTreeSumsBitForBitAndGathersExactOnEveryLayout) {
  const std::vector<std::vector<int>> layouts = {
      {0},          {0, 0},          {0, 1},       {0, 0, 1, 1},    {0, 0, 0, 1, 1, 1},
      {0, 1, 1},    {0, 1, 0, 1},    {5, 5, 5, 5, 9, 9, 9, 9},      {0, 0, 1, 1, 2},
      {0, 0, 1, 1, 1, 1, 2, 2, 3},   {0, 0, 0, 0, 0, 0, 0, 1},      {1, 0, 0, 0, 0, 0, 0, 0}};
  for (const auto& host : layouts) {
    const int P = int(host.size());
    std::vector<int64_t> even(static_cast<size_t>(P), 13), uneven(static_cast<size_t>(P));
    for (int r = 0; r < P; ++r) uneven[size_t(r)] = (r * 7) % 5;  // zeros included
    SCOPED_TRACE(::testing::PrintToString(host));
    for (const std::vector<int64_t>& counts : {even, uneven}) {
      run<float>(host, true, counts);
      run<double>(host, true, counts);
      run<float>(host, false, counts);
      run<double>(host, false, counts);
    }
  }
}

TEST(HostFirst, TheBytesOutOfEachHostAreThePlans) {
  for (const auto& host : std::vector<std::vector<int>>{{0, 0, 1, 1}, {0, 0, 0, 1, 1, 1},
                                                         {0, 0, 0, 0, 1, 1, 1, 1}, {0, 1, 1}}) {
    SCOPED_TRACE(::testing::PrintToString(host));
    const HostPlan plan(host);
    const int P = plan.size();
    const int64_t n = 64, vector_bytes = n * P * int64_t(sizeof(float));
    const std::vector<int64_t> counts(size_t(P), n);
    int64_t sums = 0, gathers = 0;
    for (int64_t b : run<float>(host, true, counts, 1)) sums = std::max(sums, b);
    for (int64_t b : run<float>(host, false, counts, 1)) gathers = std::max(gathers, b);
    EXPECT_EQ(sums, int64_t(std::lround(plan.reduce_cross().host_first * double(vector_bytes))));
    EXPECT_EQ(gathers, int64_t(std::lround(plan.gather_cross().host_first * double(vector_bytes))));
    if (plan.sums_host_first()) {
      EXPECT_LT(sums, int64_t(plan.reduce_cross().direct * double(vector_bytes)));
    }
  }
}
