// Host-first sums and gathers (docs/distributed.md, "Placement across hosts"): where several
// ranks of a communicator share a host, a reduction adds their parts inside the host first and
// only the host's partial sums cross to the other hosts, and a gather crosses once per host and
// fans out inside it. Bit-identity is kept: the ranks of a communicator add in tree_sum's fixed
// rank-order tree (dist/communicator.h), and a host adds only parts that form whole subtrees of
// that tree, so the owner finishes the same tree with the same additions in the same order.
//
// HostPlan: which ranks share a host, the tree's subtrees each host holds whole, and who adds
// and who forwards what. HostFirstReduce and HostFirstGather: one rank's side of a collective,
// two rounds of point-to-point messages over a transport (PointToPoint; the MPI communicator's,
// or a test's), usable blocking (wait) or non-blocking (test as the caller's work goes on).
// Nothing here calls MPI.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/uninit_vector.h"
#include "dist/communicator.h"

namespace sigma {

class HostPlan {
 public:
  // host_of_rank[r]: an id shared by the ranks on the same host (any ints). allow = false: every
  // collective direct (SIGMA_HOST_FIRST=0), the plan still describes what host-first would do.
  // Empty: one rank.
  explicit HostPlan(const std::vector<int>& host_of_rank = {}, bool allow = true);

  int size() const { return int(host_.size()); }
  int hosts() const { return int(members_.size()); }
  int host_of(int r) const { return host_[size_t(r)]; }  // 0 .. hosts() - 1, by first rank
  const std::vector<int>& members(int h) const { return members_[size_t(h)]; }  // ascending

  // The maximal subtrees of tree_sum's tree over size() parts (rank order) whose ranks share a
  // host: ranks [lo, hi), in rank order, covering every rank once. A lone rank is a block.
  struct Block {
    int lo, hi;
  };
  const std::vector<Block>& blocks() const { return blocks_; }
  int block_of(int r) const { return block_of_[size_t(r)]; }

  // Whether sums go host-first: allowed, ranks on 2 hosts or more, and a block of 2 ranks or
  // more (otherwise host-first would send what the direct path sends).
  bool sums_host_first() const { return sums_; }
  // Whether gathers go host-first: allowed, 2 hosts or more, one of them with 2 ranks or more.
  bool gathers_host_first() const { return gathers_; }

  // The rank of `block` that adds the block's parts for `owner`: the owner itself when it is in
  // the block, else one of the block's ranks, spread over them.
  int reducer(int block, int owner) const;
  // The rank of `host` that receives `source`'s piece for the whole host (source elsewhere).
  int gateway(int host, int source) const;

  // Out of the busiest host, for one reduce-scatter (or one all-gather) of a vector spread
  // evenly over the ranks: the fraction of the vector's bytes the direct path sends to other
  // hosts, what host-first sends, and what it would send if the hosts aligned with the tree
  // (one partial sum per host and owner).
  struct Cross {
    double direct = 0, host_first = 0, aligned = 0;
  };
  Cross reduce_cross() const;
  Cross gather_cross() const;
  // One line for the start of a run (empty for one host): the hosts, the path each kind of
  // collective takes and the bytes each path sends across hosts.
  std::string describe() const;

 private:
  std::vector<int> host_;
  std::vector<std::vector<int>> members_;
  std::vector<Block> blocks_;
  std::vector<int> block_of_;
  bool allow_ = true, sums_ = false, gathers_ = false;
};

// n elements of a collective's type from or into `data`, to or from rank `peer`.
struct Transfer {
  void* data;
  size_t n;
  int peer;
};

// Point-to-point messages posted together, complete when every one is.
class Messages {
 public:
  virtual ~Messages() = default;
  virtual bool test() = 0;  // advances them; whether all are complete
  virtual void wait() = 0;  // completes them (the transport's timeout applies)
};

class PointToPoint {
 public:
  virtual ~PointToPoint() = default;
  // Messages between two ranks on one tag are matched in the order they are posted (MPI's rule).
  virtual std::unique_ptr<Messages> post(const std::vector<Transfer>& sends,
                                         const std::vector<Transfer>& recvs, size_t elem_bytes,
                                         int tag) = 0;
};

// The two tags of the host-first collective number `seq` (the how-manieth non-blocking one
// started on a communicator: the same on every rank, as they are started in the same order).
// Each op's rounds have tags of their own, so that ops in flight, whose second rounds each rank
// posts when its first round completes there, never take each other's messages. At most
// kHostFirstOpsInFlight of them may be in flight on one communicator; the blocking ones use
// kHostFirstBlockingTag and the next.
constexpr int kHostFirstOpsInFlight = 8192;
constexpr int kHostFirstBlockingTag = 8100;
inline int host_first_tag(int64_t seq, int round) {
  return 8192 + 2 * int(seq % kHostFirstOpsInFlight) + round;
}

// An op that counts itself in flight: `live` is decremented once, when it completes (or is
// destroyed, which waits for it). The communicator's bound on host-first ops in flight.
class CountedOp final : public PendingOp {
 public:
  CountedOp(std::unique_ptr<PendingOp> op, int64_t& live) : op_(std::move(op)), live_(live) {}
  ~CountedOp() override;
  bool test() override;
  void wait() override;

 private:
  std::unique_ptr<PendingOp> op_;
  int64_t& live_;
  bool done_ = false;
};

// out[counts[me]] = the sum over ranks of each rank's in-block for `me`, added as tree_sum adds
// them in rank order; `in` holds counts[o] elements for each rank o, packed in rank order; every
// rank passes the same counts. Round 1: each rank sends its part for `owner` to the reducer of
// its block, which adds the block's parts; round 2: each reducer sends the block's partial sum
// to the owner, which finishes the tree. `out` may lie inside `in` at `me`'s part. The buffers
// stay in use until the op completes.
template <class T>
class HostFirstReduce final : public PendingOp {
 public:
  HostFirstReduce(PointToPoint& net, const HostPlan& plan, int me, T* out, const T* in,
                  const int64_t* counts, int tag1, int tag2);
  ~HostFirstReduce() override;
  bool test() override;
  void wait() override;
  const std::vector<int64_t>& bytes_to() const { return bytes_to_; }  // [rank] sent to it

 private:
  void add_block();  // after round 1: the block's partial sums, round 2 posted
  void finish();     // after round 2: the tree over the blocks' partial sums, into out
  PointToPoint& net_;
  const HostPlan& plan_;
  int me_, block_;
  T* out_;
  const T* in_;
  std::vector<int64_t> counts_, at_;  // at_[o]: owner o's part in `in`
  std::vector<int> mine_;             // the owners whose block partial this rank adds
  std::vector<UninitVector<T>> parts_;     // [i of mine_] the block's other ranks' parts
  std::vector<UninitVector<T>> partial_;   // [i of mine_] the block's partial sum for mine_[i]
  std::vector<UninitVector<T>> received_;  // [block] its partial sum for me (not my block's)
  std::unique_ptr<Messages> round1_, recv2_, send2_;
  std::vector<int64_t> bytes_to_;
  int tag2_;
  int state_ = 0;  // 0: round 1 in flight, 1: round 2, 2: complete
};

// out[sum of counts]: rank r's in[counts[r]] at its place in rank order (in may already lie
// there). Round 1: each rank sends its piece to the other ranks of its host and to one gateway
// on each other host; round 2: each gateway forwards what it received to the rest of its host.
template <class T>
class HostFirstGather final : public PendingOp {
 public:
  HostFirstGather(PointToPoint& net, const HostPlan& plan, int me, T* out, const T* in,
                  const int64_t* counts, int tag1, int tag2);
  ~HostFirstGather() override;
  bool test() override;
  void wait() override;
  const std::vector<int64_t>& bytes_to() const { return bytes_to_; }

 private:
  PointToPoint& net_;
  std::vector<Transfer> forward_;  // round 2's sends, posted when round 1 completes
  std::unique_ptr<Messages> round1_, recv2_, send2_;
  std::vector<int64_t> bytes_to_;
  int tag2_;
  int state_ = 0;
};

}  // namespace sigma
