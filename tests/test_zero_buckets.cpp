// ZeRO-1's bucketed exchange (train/shard_plan.h): gradients reach their owners and values come
// back in rounds of fixed-size buckets read straight from the tensors. With buckets far
// smaller than the tensors (slices that start and end inside tensors and cross their
// boundaries) the result must equal one round over everything bit for bit, and the owners'
// gradients must be tree_sum of the ranks' gradients in rank order.
#include <gtest/gtest.h>

#include <cstring>

#include "device_access.h"
#include "parallel/shard_plan.h"
#include "parallel/zero_overlap.h"
#include "thread_comm.h"

using namespace sigma;
using sigma::testing::append_floats;
using sigma::testing::edit_floats;

namespace {

// Parameters of uneven sizes (so the owners' streams differ in length).
ParamSet make_params() {
  ParamSet ps;
  const int64_t sizes[] = {37, 5, 64, 1, 23, 11, 90, 2};
  for (size_t i = 0; i < std::size(sizes); ++i) ps.add("p" + std::to_string(i), Shape{sizes[i]}, false);
  return ps;
}

// Not inlined: one compiled body, so FMA contraction cannot make two call sites differ.
[[gnu::noinline]] float grad_of(int rank, size_t param, int64_t i) { return 0.1f * float(rank + 1) + 0.37f * float(param) + 1.0f / float(i + 3); }
[[gnu::noinline]] float value_of(size_t param, int64_t i) { return 3.0f * float(param) - 0.01f * float(i); }

// Runs reduce + gather on R thread ranks with the given bucket; returns, per rank, the
// owned gradients (concatenated in parameter order) and every value.
// overlapped: the same through ZeroOverlap (parallel/zero_overlap.h), the tensors in four
// stages as backward and forward hand them over (p6 in two pieces, as an expert's slices of a
// stacked tensor), at most `bound` elements in flight.
// slab: the norm's slab, which a plan's cuts follow (8: p2 and p6 are cut over the ranks).
std::vector<std::vector<float>> exchange(int R, size_t bucket, bool overlapped = false,
                                         size_t bound = 0, int64_t slab = kNormSlabElements) {
  std::vector<std::vector<float>> out(static_cast<size_t>(R));
  test_ranks::run_ranks(R, [&](Communicator& comm) {
    ParamSet ps = make_params();
    const ShardPlan plan = plan_shards(ps, R, slab);
    auto& all = ps.all();
    for (size_t p = 0; p < all.size(); ++p) {
      edit_floats(all[p].grad, [&](float* g, int64_t n) {
        for (int64_t i = 0; i < n; ++i) g[i] = grad_of(comm.rank(), p, i);
      });
      // Owners hold the true value; the others hold garbage that must be overwritten.
      edit_floats(all[p].value, [&](float* v, int64_t n) {
        for (int64_t i = 0; i < n; ++i) v[i] = plan.owner_of(p, i) == comm.rank() ? value_of(p, i) : -999.0f;
      });
    }
    if (overlapped) {
      ZeroOverlap zo(comm, plan, ps, bucket, bound ? bound : 8 * kZeroBucketElements);
      auto whole = [&](size_t i) { return whole_param(ps, i); };
      const std::vector<ParamStage> stages{{{6, 45, 90}, whole(7)},
                                           {{6, 0, 45}},
                                           {whole(2), whole(3), whole(4), whole(5)},
                                           {whole(0), whole(1)}};
      for (const ParamStage& pieces : stages) {
        zo.start_reduce(pieces);
        zo.progress();
      }
      zo.finish_reduce();
      for (size_t s = stages.size(); s-- > 0;) zo.start_gather(stages[s], int(s));
      for (size_t s = stages.size(); s-- > 0;) zo.finish_gather(int(s));
      EXPECT_FALSE(zo.gathers_pending());
    } else {
      reduce_to_owners(comm, plan, ps, bucket);
      gather_from_owners(comm, plan, ps, bucket);
    }
    std::vector<float>& mine = out[size_t(comm.rank())];
    for (size_t p = 0; p < all.size(); ++p) {
      const ParamPiece own = plan.owned(p, comm.rank());
      const std::vector<float> g = sigma::testing::host_floats(all[p].grad);
      mine.insert(mine.end(), g.begin() + own.begin, g.begin() + own.end);
      append_floats(mine, all[p].value);
    }
  });
  return out;
}

}  // namespace

TEST(ZeroBuckets, SmallBucketsGiveTheOneRoundResultAndTheTreeSum) {
  for (int64_t slab : {kNormSlabElements, int64_t(8)})
  for (int R : {2, 3, 4}) {
    const auto whole = exchange(R, kZeroBucketElements, false, 0, slab);
    for (size_t bucket : {size_t(1), size_t(4), size_t(7), size_t(30)})
      EXPECT_EQ(exchange(R, bucket, false, 0, slab), whole) << R << " ranks, bucket " << bucket;
    // The one-round result itself: owners hold the tree_sum of the ranks' gradients and every
    // rank every value.
    ParamSet ps = make_params();
    const ShardPlan plan = plan_shards(ps, R, slab);
    if (slab == 8) {
      EXPECT_FALSE(plan.whole(6)) << "p6 is cut at " << R << " ranks";
    }
    std::vector<size_t> at(static_cast<size_t>(R), 0);
    for (size_t p = 0; p < ps.all().size(); ++p)
      for (int r = 0; r < R; ++r) {
        const int64_t n = ps.all()[p].value.numel();
        const ParamPiece own = plan.owned(p, r);
        {
          for (int64_t i = own.begin; i < own.end; ++i) {
            std::vector<float> parts(static_cast<size_t>(R));
            std::vector<const float*> ptr;
            for (int q = 0; q < R; ++q) parts[size_t(q)] = grad_of(q, p, i);
            for (int q = 0; q < R; ++q) ptr.push_back(&parts[size_t(q)]);
            float want = 0;
            tree_sum(&want, ptr.data(), R, 1);
            ASSERT_EQ(whole[size_t(r)][at[size_t(r)]++], want) << "grad of p" << p << "[" << i << "]";
          }
        }
        for (int64_t i = 0; i < n; ++i)
          ASSERT_EQ(whole[size_t(r)][at[size_t(r)]++], value_of(p, i)) << "value of p" << p << " on rank " << r;
      }
  }
}

// The overlapped exchange (dist.overlap) gives the same bits in stages, with any bucket, and
// with a bound on the buffers in flight that forces the oldest rounds to complete first.
TEST(ZeroBuckets, TheOverlappedExchangeGivesTheSameBits) {
  for (int64_t slab : {kNormSlabElements, int64_t(8)})
    for (int R : {2, 3, 4}) {
      const auto whole = exchange(R, kZeroBucketElements, false, 0, slab);
      for (size_t bucket : {size_t(1), size_t(7), kZeroBucketElements})
        for (size_t bound : {size_t(0), size_t(1), size_t(40)})
          EXPECT_EQ(exchange(R, bucket, true, bound, slab), whole)
              << R << " ranks, bucket " << bucket << ", bound " << bound << ", slab " << slab;
    }
}
