// ZeRO's exchanges overlapped with compute (docs/distributed.md, "Communication hidden behind
// compute"). The same bucketed rounds as reduce_to_owners and gather_from_owners
// (parallel/shard_plan.h), started as non-blocking collectives (Communicator::start_*) as soon
// as their data is ready and taken in when complete:
//  - start_reduce(pieces) as backward finishes a stage (a block's or an expert's gradients):
//    they are packed at once (so they may be released or overwritten after), and each round is a
//    non-blocking reduce_scatter_sum_v: the R parts of each owner's slice added by tree_sum in
//    rank order, the same sums in the same order as reduce_to_owners, so the same bits;
//  - start_gather(pieces, key) after the update: the owners' new values go to every rank, and
//    finish_gather(key) waits for them where the next forward first reads them.
// progress() advances what is in flight (the MPI progress strategy: a test at each layer
// boundary, where the step calls it) and takes in what has arrived. Buffers in flight are
// bounded (max_in_flight elements): past it, the oldest round is completed first. That bound
// is decided alike on every rank: a rank that waits for a round while another goes on to a
// blocking collective deadlocks when the round needs the other rank to move it on (a
// host-first op's forwarder). So it counts each round at its size on the rank with the largest
// slice, and a round stays counted until a wait every rank makes (the bound's, or a finish_*)
// retires it, even when progress() took it in earlier.
#pragma once
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <vector>

#include "dist/communicator.h"
#include "model/params.h"
#include "parallel/shard_plan.h"

namespace sigma {

namespace zero_detail {
class OwnerStreams;
}

class ZeroOverlap {
 public:
  ZeroOverlap(Communicator& comm, const ShardPlan& plan, ParamSet& ps,
              size_t bucket = kZeroBucketElements, size_t max_in_flight = 8 * kZeroBucketElements);
  ~ZeroOverlap();
  ZeroOverlap(const ZeroOverlap&) = delete;
  ZeroOverlap& operator=(const ZeroOverlap&) = delete;

  // Starts reducing these pieces' gradients to their owners (ascending). The gradients are
  // read now.
  void start_reduce(const ParamStage& pieces);
  // Completes every reduction started: each owner's gradients hold the sums over the ranks.
  void finish_reduce();
  // Starts sending the owners' values of these pieces to every rank, under `key`.
  void start_gather(const ParamStage& pieces, int key);
  // Completes the gathers started under `key`; the other ranks' tensors then hold the owners'
  // values. finish_gathers(): every gather in flight.
  void finish_gather(int key);
  void finish_gathers();
  bool gathers_pending() const;
  // Tests what is in flight and takes in the rounds that are complete.
  void progress();

  // Seconds spent blocked in finish_* and in waits for the bound, since construction.
  double blocked_s() const { return blocked_s_; }
  // The most elements of exchange buffers in flight at once, since construction (the bound,
  // or one round where a round alone exceeds it).
  size_t peak_in_flight() const { return peak_in_flight_; }

 private:
  struct Round;  // one bucketed round in flight (zero_overlap.cpp)
  void launch(std::unique_ptr<Round> r, size_t counted);
  size_t counted_size(const zero_detail::OwnerStreams& st, size_t k, size_t S, bool reduce) const;
  void make_room(size_t counted);  // completes the oldest rounds until `counted` more fit
  void take_in(Round& r);
  void complete(int which, int key);

  Communicator& comm_;
  const ShardPlan& plan_;
  ParamSet& ps_;
  size_t bucket_, max_in_flight_;
  size_t in_flight_ = 0, peak_in_flight_ = 0;  // this rank's buffers not yet taken in
  size_t counted_ = 0;                          // the rounds_' sizes as the bound counts them
  std::deque<std::unique_ptr<Round>> rounds_;   // not yet retired, in the order started
  double blocked_s_ = 0;
};

}  // namespace sigma
