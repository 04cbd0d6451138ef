// Data parallelism for the shared parameters (DESIGN §9): ZeRO-1 at tensor granularity. Each
// parameter tensor is owned by one rank, which alone holds its Adam state and updates it. A
// step's gradients go to their owners, summed by tree_sum in rank order (deterministic: the
// same bits as one rank summing the same micro-batches), and the owners' updated values go
// back to every rank. Whole tensors keep the norm's pieces, lazy embedding rows and frozen
// masks exactly as on one rank; the cost is a coarser balance (reported per rank).
#pragma once
#include <cstdint>
#include <vector>

#include "dist/communicator.h"
#include "model/params.h"

namespace sigma {

struct ShardPlan {
  int ranks = 1;
  std::vector<int> owner;                // [params]: the rank that updates param i
  std::vector<int64_t> elements;         // [ranks]: parameter elements each rank owns
  // owned[i] != 0 when `rank` owns param i (the AdamW mask of that rank).
  std::vector<uint8_t> owned_by(int rank) const;
};

// Largest tensors first, each to the rank owning the fewest elements so far (ties: lowest
// rank): deterministic, so every rank computes the same plan.
ShardPlan plan_shards(const ParamSet& ps, int ranks);

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
