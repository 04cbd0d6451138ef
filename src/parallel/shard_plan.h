// Data parallelism for the shared parameters (DESIGN §9): ZeRO. Each parameter tensor, or
// each run of its rows, is owned by one rank, which alone holds its Adam state and updates
// it. A step's gradients go to their owners, summed by tree_sum in rank order (deterministic:
// the same bits as one rank summing the same micro-batches), and the owners' updated values
// go back to every rank. Tensors are owned whole, except one larger than half a rank's fair
// share (a real-text vocabulary's embedding table is most of a small model): it is cut into
// row runs, one per rank, on slab boundaries (optim/grad_norm.h: the norm's pieces are
// slabs, so every cut keeps one rank's bits).
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

#include "dist/communicator.h"
#include "model/params.h"
#include "optim/grad_norm.h"

namespace sigma {

struct ShardPlan {
  int ranks = 1;
  int64_t slab = 0;  // the norm's slab (elements): cuts fall on slab boundaries
  // [params][ranks + 1]: rank r owns elements [cuts[i][r], cuts[i][r + 1]) of param i.
  std::vector<std::vector<int64_t>> cuts;
  std::vector<int64_t> elements;  // [ranks]: parameter elements each rank owns
  ParamPiece owned(size_t i, int rank) const {
    return {i, cuts[i][size_t(rank)], cuts[i][size_t(rank) + 1]};
  }
  // [params]: what `rank` owns of each (empty pieces where nothing).
  std::vector<ParamPiece> owned_by(int rank) const;
  // True when param i is owned whole by one rank.
  bool whole(size_t i) const;
  // The rank owning param i's element `at`.
  int owner_of(size_t i, int64_t at) const;
};

// Largest tensors first: one larger than half a rank's fair share (and `may_split`) is cut
// over the ranks so that their loads even out, the others go whole to the rank owning the
// fewest elements so far (ties: lowest rank). Deterministic: every rank computes the same.
// `slab`: the grad norm's slab (tests shrink it to cut small tensors).
ShardPlan plan_shards(const ParamSet& ps, int ranks, int64_t slab = kNormSlabElements,
                      const std::function<bool(size_t)>& may_split = nullptr);

// Piece p without the part `mine` covers (same param): up to two pieces, appended to out.
void add_outside(std::vector<ParamPiece>& out, const ParamPiece& p, const ParamPiece& mine);

// Each parameter's gradient, summed over the ranks, lands in its owner's grad (tree_sum in
// rank order); the other ranks' copies are left as they were and must not be used. Moved in
// rounds of fixed-size buckets straight from the gradient tensors (no copy of them all).
// `bucket`: elements per round over all owners (tests shrink it to cross tensor boundaries).
// `only`: the pieces of the parameters to reduce (ascending; ZeRO-2 reduces each stage of
// backward as it finishes), null = all. Each element's sum is the same whatever the rounds.
constexpr size_t kZeroBucketElements = size_t(1) << 22;  // 16 MiB of fp32
// ZeRO-3's rounds, smaller: each round's packed copy and receive buffer sit on top of the
// gathered stage (one expert at most) and its gradients at the peak: at d = 512, R = 4 a rank
// peaks 3-11 MiB lower with 1 MiB rounds than with 4 MiB ones (issue 38); a 10 Gbit/s link
// still takes ~0.8 ms a round, 8x its latency.
constexpr size_t kZero3BucketElements = size_t(1) << 18;
void reduce_to_owners(Communicator& comm, const ShardPlan& plan, ParamSet& ps,
                      size_t bucket = kZeroBucketElements, const ParamStage* only = nullptr);

// Every rank receives every parameter's value from its owner, in the same fixed-size rounds.
// `only`: these pieces' (ascending; ZeRO-3 gathers a stage before it is read), null = all.
void gather_from_owners(Communicator& comm, const ShardPlan& plan, ParamSet& ps,
                        size_t bucket = kZeroBucketElements, const ParamStage* only = nullptr);

}  // namespace sigma
